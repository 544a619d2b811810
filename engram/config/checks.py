"""The one error type of a bad configuration and the checks that raise it."""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A configuration problem; the message says how to fix it."""


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_finite(value: float, key: str, hint: str = "") -> None:
    """NaN compares false with everything and inf passes `> 0`: reject both by name."""
    check(math.isfinite(value), f"{key} must be a finite number, got {value!r} {hint}".rstrip())
