"""Reading a job configuration: TOML file + `--section.key=value` overrides -> JobConfig (the
typed sections in engram/config/schema.py and the section modules), and JobConfig -> TOML.

An unknown section or key, a value of the wrong type or an inconsistent value is a ConfigError
that names the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import typing
from pathlib import Path
from typing import Any

from engram.config.checks import ConfigError, check
from engram.config.model import Lora
from engram.config.schema import JobConfig
from engram.config.table_optimizers import table_optimizer_spec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Check/convert a TOML or CLI value to the annotated field type."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):  # a table inside a list, e.g. data.sources entries
        check(
            isinstance(value, dict), f"{where} must be a table {{key = value, ...}}, got {value!r}"
        )
        hints = typing.get_type_hints(tp)
        known = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - known)
        check(
            not unknown,
            f"unknown key(s) {unknown} in {where}; valid keys: {', '.join(sorted(known))}",
        )
        return tp(**{k: _convert(v, hints[k], f"{where}.{k}") for k, v in value.items()})
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str) and dataclasses.is_dataclass(item_tp):
            raise ConfigError(
                f"{where} is a list of tables: set it in the TOML file, not on the CLI"
            )
        if isinstance(value, str):  # CLI: --engram.layer_ids=1,3
            value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        check(isinstance(value, list), f"{where} must be a list, got {value!r}")
        return [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "1", "false", "0"):
            return value.lower() in ("true", "1")
        check(isinstance(value, bool), f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"{where} must be an integer, got {value!r}") from None
        check(
            isinstance(value, int) and not isinstance(value, bool),
            f"{where} must be an integer, got {value!r}",
        )
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{where} must be a number, got {value!r}") from None
        check(
            isinstance(value, (int, float)) and not isinstance(value, bool),
            f"{where} must be a number, got {value!r}",
        )
        return float(value)
    if tp is str:
        check(isinstance(value, str), f"{where} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {tp} at {where}")


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _build(raw: dict[str, dict[str, Any]], source: str) -> JobConfig:
    sections = _section_types()
    kwargs = {}
    for name, values in raw.items():
        check(
            name in sections,
            f"{source}: unknown section [{name}]; valid sections: {', '.join(sections)}",
        )
        check(isinstance(values, dict), f"{source}: [{name}] must be a table of key = value")
        cls = sections[name]
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            check(
                key in known,
                f"{source}: unknown key {name}.{key}; valid keys of [{name}]: {', '.join(sorted(known))}",
            )
        converted = {k: _convert(v, hints[k], f"{name}.{k}") for k, v in values.items()}
        kwargs[name] = cls(**converted)
    cfg = JobConfig(**kwargs)
    # Refused, not warned: without lora mode no adapter exists, so the settings would do nothing.
    changed = [
        f.name
        for f in dataclasses.fields(Lora)
        if getattr(cfg.lora, f.name) != getattr(Lora(), f.name)
    ]
    check(
        not changed or cfg.training.mode == "lora",
        f"{source}: lora.{', lora.'.join(changed)} set but training.mode = "
        f"{cfg.training.mode!r} builds no adapters (the settings would do nothing): set "
        'training.mode = "lora" or remove them',
    )
    check(
        not cfg.checkpoint.trainable_only or cfg.training.mode != "full",
        "checkpoint.trainable_only = true with training.mode = 'full' would save nothing of the "
        "backbone it trains: set training.mode to lora or engram_only, or trainable_only = false",
    )
    check(
        cfg.checkpoint.table_full_every == 1
        or (cfg.engram.enabled and table_optimizer_spec(cfg.optimizer.table_optimizer).row_sparse),
        f"checkpoint.table_full_every = {cfg.checkpoint.table_full_every} (incremental table "
        "checkpoints) needs Engram tables with a row-sparse table optimizer (it records the rows "
        'it updates): set optimizer.table_optimizer = "lazy_adam" or "rowwise_adagrad", '
        "or checkpoint.table_full_every = 1",
    )
    return cfg


def _merge(raw: dict[str, dict[str, Any]], overrides: list[str]) -> dict[str, dict[str, Any]]:
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        check(
            item.startswith("--") and "." in item,
            f"bad override {item!r}: use --section.key=value (e.g. --training.steps=10)",
        )
        key, eq, value = item[2:].partition("=")
        check(bool(eq), f"bad override {item!r}: missing '=value' (use --section.key=value)")
        section, _, name = key.partition(".")
        merged.setdefault(section, {})
        check(isinstance(merged[section], dict), f"bad override {item!r}")
        merged[section][name] = value
    return merged


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Parse `--job.config_file PATH` plus `--section.key=value` overrides (CLI wins over TOML)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(add_help=True, description="Engram training job")
    parser.add_argument("--job.config_file", dest="config_file", default="")
    args, rest = parser.parse_known_args(argv)
    raw: dict[str, dict[str, Any]] = {}
    source = "command line"
    if args.config_file:
        path = Path(args.config_file)
        check(
            path.is_file(),
            f"config file {path} does not exist (set CONFIG_FILE / --job.config_file to a TOML file)",
        )
        with path.open("rb") as f:
            try:
                raw = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: invalid TOML: {e}") from None
        if not raw:
            logging.getLogger("engram").warning(
                "config file %s is empty: every setting takes its default value", path
            )
        source = str(path)
    merged = _merge(raw, rest)
    merged.setdefault("job", {})["config_file"] = args.config_file
    return _build(merged, source)


def config_from_dict(raw: dict[str, dict[str, Any]]) -> JobConfig:
    """Build a JobConfig from nested dicts (tests, programmatic use); same checks as TOML."""
    return _build(raw, "config dict")


def to_toml(cfg: JobConfig) -> str:
    """Serialise a JobConfig to TOML (round-trips through load_config)."""
    return sections_to_toml(cfg.to_dict())


def sections_to_toml(sections: dict[str, dict[str, Any]]) -> str:
    """Sections of scalars / lists / inline tables (the JobConfig shape) as TOML."""
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string literal is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # inline table (entries of a list of tables)
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)
