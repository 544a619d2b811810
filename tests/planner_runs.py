"""Planner dry runs computed once per test process: a shipped config planned at one world size
(planner.estimate.estimate under a fake process group, in an isolated process) that several
planner tests check. Keyed by config file, overrides, world size and estimate's arguments; the
cached result is shared, so callers treat it as read-only (they only read it)."""

from __future__ import annotations

import functools

from launcher import run_isolated
from small_job import load_shipped


def planned(path: str, *overrides: str, world: int, **kwargs):
    """estimate(load_shipped(path, *overrides), world, **kwargs), computed once per process.
    List arguments (ranks) may be given as lists; they are keyed as tuples."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
    return _planned(path, overrides, world, frozen)


@functools.cache
def _planned(path: str, overrides: tuple[str, ...], world: int, kwargs: tuple):
    from planner.estimate import estimate

    args = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs}
    return run_isolated(estimate, load_shipped(path, *overrides), world, timeout=600, **args)
