"""Runs computed once per test session: a reference run that several tests compare against.

`shared_run(fn, world, raw)` is `run_distributed(fn, world, raw)` for a run whose result depends
only on its config: the first call runs it, later calls with the same function, world size and
config (all but where it writes, [job] dump_folder / run_name) get a copy of the same results.
Use it for single-process references and for layouts that several tests train identically; not
for a run whose folder a test reads afterwards (checkpoints, metrics files): the later callers'
folders stay empty. A run that would start from files already in its folder is refused.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from launcher import run_distributed

_RUNS: dict[str, list[Any]] = {}
# (hits, misses) over the session: printed with the launch count at the end of the run.
STATS = {"computed": 0, "shared": 0}


def run_key(fn: Any, world: int, raw: dict, args: tuple = ()) -> str:
    """What a run's result depends on: the function, the world size, the config less the
    output location, and any further arguments."""
    job = {k: v for k, v in raw.get("job", {}).items() if k not in ("dump_folder", "run_name")}
    canonical = {**raw, "job": job}
    return json.dumps(
        [fn.__module__, fn.__qualname__, world, canonical, repr(args)], sort_keys=True, default=str
    )


def shared_run(fn: Any, world: int, raw: dict, *args: Any, **kwargs: Any) -> list[Any]:
    """run_distributed(fn, world, raw, *args) once per session and config; see the module doc."""
    folder = Path(raw.get("job", {}).get("dump_folder", ".")) / raw.get("job", {}).get(
        "run_name", ""
    )
    if folder.is_dir() and any(folder.iterdir()):
        raise ValueError(f"{folder} is not empty: a shared run must not start from files")
    key = run_key(fn, world, raw, args)
    if key in _RUNS:
        STATS["shared"] += 1
    else:
        _RUNS[key] = run_distributed(fn, world, raw, *args, **kwargs)
        STATS["computed"] += 1
    return copy.deepcopy(_RUNS[key])
