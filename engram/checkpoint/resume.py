"""Resuming: which checkpoint to load, whether this run may load it, and reading it back.

The checkpoint manager's `load` (manager.py) calls these in order:

    candidates       rank 0: leftovers of interrupted saves removed; the steps to try, newest
                     first (checkpoint.load_step: -1 the newest intact, N exactly N, 0 none)
    choose           the first intact one (manifest, checksums, its table chain); a damaged one
                     is refused, or with checkpoint.on_damaged = "previous" passed over loudly
    check_compatible its fingerprint equals this run's, it holds every state this run has
    warn_data_changed  another global batch or seq_len per step is allowed, and said
    load_dcp         the DCP states (for a table delta: the chain's base, the deltas replayed,
                     then the step's own DCP part)
    load_json_states the per-rank JSON states: one every rank saved alike loads at any world
                     size; per-rank positions need the saved world size; RNG is skipped there

Every function but `candidates` is collective.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engram.checkpoint.dcp_io import dcp_load
from engram.checkpoint.errors import CheckpointError
from engram.checkpoint.folder import (
    FINGERPRINT_FILE,
    META_FILE,
    fingerprint_mismatches,
    manifest_crc,
    read_manifest,
    verify_checkpoint,
)
from engram.checkpoint.step_folder_ops import StepFolders
from engram.checkpoint.streamed_dcp import StreamedLoadPlanner
from engram.checkpoint.table_delta import TableDeltas, chain_of, chain_problems
from engram.config import Checkpoint
from engram.rowstore.streamed_columns import streamed_columns

logger = logging.getLogger("engram")

RNG_KEY = "rng"


def candidates(folders: StepFolders, cfg: Checkpoint, dirs: set[str]) -> list[int]:
    """Rank 0: the steps to try, newest first; [] for a fresh start."""
    folders.clean_tmp(dirs)
    steps = folders.steps()
    if cfg.load_step == 0:
        if steps:
            logger.warning(
                "checkpoint.load_step = 0: starting from step 0 although %s holds "
                "checkpoints %s (they are kept)",
                folders.folder,
                steps,
            )
        return []
    if cfg.load_step > 0:
        if cfg.load_step not in steps:
            raise CheckpointError(
                f"checkpoint.load_step={cfg.load_step} but {folders.folder} has no "
                f"step-{cfg.load_step}; checkpoints: {steps or 'none'}. Set "
                "checkpoint.load_step to one of them, -1 for the newest, or 0 to start fresh"
            )
        return [cfg.load_step]
    return steps[::-1]


def choose(folders: StepFolders, cfg: Checkpoint, choice: list[int]) -> tuple[int, Path]:
    """The first intact checkpoint of `choice` (collective: every rank verifies a share)."""
    damaged: list[str] = []
    for step in choice:
        path = folders.step_dir(step)
        problems = verify_checkpoint(path) or _chain_problems(folders, path)
        if not problems:
            return step, path
        damaged.append(f"{path}:\n    " + "\n    ".join(problems))
        if cfg.on_damaged == "error" or cfg.load_step > 0:
            raise CheckpointError(
                f"checkpoint {path} is damaged or incomplete:\n    "
                + "\n    ".join(problems)
                + "\nNothing was changed in the folder. Fix: restore the files, set "
                'checkpoint.on_damaged = "previous" to resume from the newest intact '
                "checkpoint, or checkpoint.load_step to another step (0: start fresh)"
            )
        logger.error(
            "CHECKPOINT %s IS DAMAGED, falling back to an older one "
            "(checkpoint.on_damaged = previous):\n    %s",
            path,
            "\n    ".join(problems),
        )
    raise CheckpointError(
        f"{folders.folder} holds checkpoints but none is intact:\n  "
        + "\n  ".join(damaged)
        + "\nRefusing to start from step 0 over them. Fix: restore the files, or set "
        "checkpoint.load_step = 0 to start fresh (the damaged checkpoints are kept), or "
        "use another checkpoint.folder"
    )


def _chain_problems(folders: StepFolders, path: Path) -> list[str]:
    """Problems of the steps a table delta at `path` needs (collective, like verify)."""
    return chain_problems(
        path, read_manifest(path), folders.step_dir, manifest_crc, verify_checkpoint
    )


def check_compatible(
    path: Path,
    fingerprint: dict[str, Any],
    state_names: set[str],
    json_names: list[str],
    rank: int,
) -> dict[str, Any]:
    """meta.json of `path`, after its fingerprint and states are checked against this run's."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        saved_fp = json.loads((path / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"rank {rank} cannot read {getattr(e, 'filename', None) or path}: {e}. "
            "On several nodes the checkpoint folder (job.dump_folder) must be on a "
            "filesystem shared by all nodes"
        ) from None
    fix = (
        "Nothing was changed in the run folder. Fix: run with the config this checkpoint "
        "was written with, or start a fresh run (a new job.run_name, or another "
        "job.dump_folder)."
    )
    diffs = fingerprint_mismatches(saved_fp, fingerprint)
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} was written by a different configuration:\n  "
            + "\n  ".join(diffs)
            + f"\n{fix}"
        )
    missing = sorted(state_names - set(meta["states"]))
    if missing:
        raise CheckpointError(
            f"checkpoint {path} has no state for {missing} (it holds {meta['states']}). {fix}"
        )
    lacking = sorted(set(json_names) - set(meta.get("json_states", [])))
    if lacking:
        raise CheckpointError(f"checkpoint {path} has no state for {lacking}. {fix}")
    return meta


def warn_data_changed(
    path: Path, saved: dict[str, Any], data_meta: dict[str, Any], rank: int
) -> None:
    changed = {k: (saved[k], v) for k, v in data_meta.items() if k in saved and saved[k] != v}
    if changed and rank == 0:
        logger.warning(
            "resuming %s with another data consumption per step: %s. The data continues "
            "from the saved position, but every step from here takes the new amount, so "
            "the steps do not see the samples the original run's steps would have, "
            "tokens_seen counts the new size and the lr schedule (by step) spreads over a "
            "different number of samples. Resume with the saved values to continue the "
            "original data order",
            path,
            ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()),
        )


def load_dcp(
    folders: StepFolders,
    path: Path,
    step: int,
    dcp_state: Callable[[], dict[str, Any]],
    tables: TableDeltas | None,
) -> list[int]:
    """The DCP state of `path` into `dcp_state()` (a fresh dict per call: dcp.load replaces its
    Stateful values); for a table delta, the base's, then the deltas replayed, then the step's
    own DCP part (everything but the tables). Returns the table chain loaded."""
    chain = chain_of(read_manifest(path), step)
    if len(chain) > 1:
        if tables is None:  # (a pipeline stage may hold no table: it has none)
            raise CheckpointError(
                f"checkpoint {path} holds its tables as deltas on step-{chain[0]} but this "
                "run has no row-sparse Engram tables to replay them into"
            )
        base = folders.step_dir(chain[0])
        with streamed_columns():  # NVMe tables load chunk by chunk (streamed_dcp.py)
            dcp_load(dcp_state(), base, planner=StreamedLoadPlanner())
        for s in chain[1:]:
            saved = json.loads((folders.step_dir(s) / META_FILE).read_text())["world_size"]
            tables.apply(folders.step_dir(s), int(saved))
        dcp_load(tables.without_tables(dcp_state()), path)
    else:
        with streamed_columns():
            dcp_load(dcp_state(), path, planner=StreamedLoadPlanner())
    if tables is not None:
        tables.reset()
    return chain


def load_json_states(
    path: Path,
    meta: dict[str, Any],
    states: dict[str, Any],
    rank: int,
    world_size: int,
) -> None:
    """`states` (name -> object with load_state_dict) from their `<name>.rank<k>.json` files."""
    saved_world = int(meta["world_size"])
    for name, obj in states.items():
        saved = []
        for k in range(saved_world):
            try:
                saved.append(json.loads((path / f"{name}.rank{k}.json").read_text()))
            except (OSError, ValueError) as e:
                raise CheckpointError(
                    f"checkpoint {path}: {name}.rank{k}.json cannot be read: {e}"
                ) from None
        if all(s == saved[0] for s in saved):
            obj.load_state_dict(saved[0])  # global: any world size
        elif saved_world == world_size:
            obj.load_state_dict(saved[rank])
        elif name == RNG_KEY:
            if rank == 0:
                logger.warning(
                    "checkpoint %s was saved by %d ranks, this run has %d: the per-rank RNG "
                    "states are not restored",
                    path,
                    saved_world,
                    world_size,
                )
        else:
            raise CheckpointError(
                f"checkpoint {path} was saved by {saved_world} ranks but this run has "
                f"{world_size}, and its {name!r} state differs between ranks (a "
                f"per-rank position), so it cannot be resharded. Resume with {saved_world} "
                "ranks, or use a loader whose state is global (the same on every rank)"
            )
