"""Distributed checkpointing (torch.distributed.checkpoint) with crash-safe step folders.

Layout under `<run_folder>/<checkpoint.folder>/`:

    step-<N>/        DCP shards (__<rank>_0.distcp), DCP .metadata, meta.json, fingerprint.json
    step-<N>.tmp/    a save in progress (or one that crashed): ignored on load, then removed
    latest           the newest complete step, for humans and scripts (load scans the folders)

A save writes into `step-<N>.tmp/`; after every rank has finished, rank 0 adds meta.json and
fingerprint.json and renames the folder to `step-<N>/` (an atomic rename), so a folder without
the `.tmp` suffix is always complete. Older checkpoints are pruned only after that rename.
All ranks must see the same folder: on several nodes it has to be a shared filesystem.

Model and optimizer state are DTensor-aware (FSDP2 shards, row-sharded Engram tables), so they
reload at another world size. Per-rank state (data loader position, RNG) is stored under
`<name>.rank<k>` keys and needs the same world size.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from engram.config import Checkpoint

logger = logging.getLogger("engram")

_STEP_RE = re.compile(r"^step-(\d+)$")
_META = "meta.json"
_FINGERPRINT = "fingerprint.json"
_RNG_KEY = "rng"
# Flattened optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") merges several
# optimizers into one dict and survives a regrouping of parameters.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used with this run; the message says why and how to fix it."""


# ----------------------------------------------------------------------------- stateful wrappers


class ModelState(Stateful):
    """A model (or its pipeline parts), FSDP2-wrapped or not, as DCP state.

    Sharded parameters stay DTensors in the state dict, so DCP writes each shard once and
    reshards on load (different world size or parallel layout)."""

    def __init__(self, model: nn.Module | Sequence[nn.Module]):
        self.parts = [model] if isinstance(model, nn.Module) else list(model)

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each pipeline part takes its own keys from the merged dict.
        strict = len(self.parts) == 1
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=strict))


class OptimizerState(Stateful):
    """One or more optimizers over (disjoint parameter sets of) one model, as DCP state."""

    def __init__(self, model: nn.Module, optimizers: torch.optim.Optimizer | Sequence[Any]):
        self.model = model
        self.optimizers = (
            [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        )

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizers, options=_OPTIM_OPTIONS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizers, state_dict, options=_OPTIM_OPTIONS)


@dataclass
class TrainState(Stateful):
    """Loop counters. Values must be global (equal on all ranks): DCP stores one copy."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class RNGState(Stateful):
    """Python, numpy, torch CPU and current-accelerator RNG states of this process."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        # check_available: a CUDA build of torch on a machine without a GPU (the registry's Linux
        # wheels) reports cuda as its accelerator, and reading its RNG state would fail.
        acc = torch.accelerator.current_accelerator(check_available=True)
        if acc is not None:
            state["accelerator"] = (acc.type, torch.get_device_module(acc.type).get_rng_state())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(state_dict["python"])
        np.random.set_state(state_dict["numpy"])
        torch.set_rng_state(state_dict["torch"])
        saved = state_dict.get("accelerator")
        acc = torch.accelerator.current_accelerator(check_available=True)
        if saved is not None and acc is not None and saved[0] == acc.type:
            torch.get_device_module(acc.type).set_rng_state(saved[1])
        elif saved is not None or acc is not None:
            logger.warning(
                "checkpoint accelerator RNG (%s) does not match this device (%s): not restored",
                saved[0] if saved else None,
                acc.type if acc else None,
            )


class _PerRankBlob(Stateful):
    """Stores a rank's state as one opaque blob.

    A fresh data loader's state_dict() need not have the same keys as a mid-epoch one, and
    DCP loads only the keys of the destination dict; one pickled leaf avoids both problems."""

    def __init__(self, inner: Any):
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.inner.state_dict(), buf)
        return {"blob": buf.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Our own file, written by torch.save above: full unpickling is intended.
        self.inner.load_state_dict(torch.load(io.BytesIO(state_dict["blob"]), weights_only=False))


# ----------------------------------------------------------------------------- helpers


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_from_rank0(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Persist renames in `path` (a durability hint: some network/FUSE filesystems refuse
    fsync on a directory, and there the rename is all we can do)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        logger.debug("fsync of directory %s not supported: %s", path, e)
    finally:
        os.close(fd)


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}, so a mismatch names the exact nested key."""
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def fingerprint_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints (after a JSON round trip)."""
    a = _flatten(json.loads(json.dumps(saved)))
    b = _flatten(json.loads(json.dumps(current)))
    missing = object()
    lines = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            sa = "<absent>" if va is missing else json.dumps(va)
            sb = "<absent>" if vb is missing else json.dumps(vb)
            lines.append(f"{key}: checkpoint {sa}, this run {sb}")
    return lines


# ----------------------------------------------------------------------------- manager


class CheckpointManager:
    """Save every `cfg.interval` steps and at the last step; resume from the newest complete one.

    `states` maps names to Stateful objects (model, optimizer, lr_scheduler, dataloader,
    train_state, ...). Names in `per_rank` hold state that differs between ranks (the data
    loader) and are saved as `<name>.rank<k>`; this process's RNG state is added the same way
    when `save_rng` is set. Every method is collective: call it on all ranks.
    """

    def __init__(
        self,
        cfg: Checkpoint,
        run_folder: Path,
        states: dict[str, Any],
        fingerprint: dict[str, Any],
        per_rank: Iterable[str] = ("dataloader",),
        save_rng: bool = True,
    ):
        self.cfg = cfg
        self.folder = Path(run_folder) / cfg.folder
        self.fingerprint = fingerprint
        self.per_rank = [k for k in per_rank if k in states]
        for name, obj in states.items():
            if not isinstance(obj, Stateful):
                raise TypeError(
                    f"checkpoint state {name!r} ({type(obj).__name__}) needs state_dict() and "
                    "load_state_dict(): wrap it (ModelState, OptimizerState, TrainState)"
                )
            if name == _RNG_KEY or ".rank" in name:
                raise ValueError(f"checkpoint state name {name!r} is reserved; rename it")
        self.states = dict(states)
        self.save_rng = save_rng
        self.rank = _rank()
        self.world_size = _world_size()

    # -- paths

    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint folder, ascending."""
        if not self.folder.is_dir():
            return []
        steps = []
        for p in self.folder.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir():
                if (p / ".metadata").is_file() and (p / _META).is_file():
                    steps.append(int(m.group(1)))
                else:
                    logger.warning("ignoring incomplete checkpoint folder %s", p)
        return sorted(steps)

    # -- state dict assembly

    def _dcp_state(self) -> dict[str, Any]:
        """A fresh dict per call: dcp.load replaces Stateful values in the dict it is given."""
        out: dict[str, Any] = {}
        for name, obj in self.states.items():
            if name in self.per_rank:
                out[f"{name}.rank{self.rank}"] = _PerRankBlob(obj)
            else:
                out[name] = obj
        if self.save_rng:
            out[f"{_RNG_KEY}.rank{self.rank}"] = _PerRankBlob(RNGState())
        return out

    def _per_rank_names(self) -> list[str]:
        return self.per_rank + ([_RNG_KEY] if self.save_rng else [])

    # -- save

    def should_save(self, step: int, last_step: bool = False) -> bool:
        return self.cfg.enable and step > 0 and (last_step or step % self.cfg.interval == 0)

    def maybe_save(self, step: int, last_step: bool = False) -> bool:
        """Save at every `interval` steps and at the last step; True if a checkpoint was written."""
        if not self.should_save(step, last_step):
            return False
        self.save(step)
        return True

    def save(self, step: int) -> Path:
        begin = time.perf_counter()
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crashed save of this step
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier()
        dcp.save(self._dcp_state(), checkpoint_id=str(tmp))
        _barrier()  # every rank's shards are on disk before the folder is declared complete
        if self.rank == 0:
            self._commit(step, tmp, final)
        _barrier()
        if self.rank == 0:
            size = sum(f.stat().st_size for f in final.iterdir()) / 2**20
            logger.info(
                "saved checkpoint %s (%.1f MiB) in %.1f s",
                final,
                size,
                time.perf_counter() - begin,
            )
        return final

    def _commit(self, step: int, tmp: Path, final: Path) -> None:
        meta = {
            "step": step,
            "world_size": self.world_size,
            "per_rank": self._per_rank_names(),
            "states": sorted(self.states),
            "torch_version": torch.__version__,
            "time": time.time(),
        }
        _write_json(tmp / _FINGERPRINT, self.fingerprint)
        _write_json(tmp / _META, meta)  # written last: its presence marks the folder complete
        if final.exists():
            # Re-saving a step (resumed from an older checkpoint): the new history wins.
            logger.warning("overwriting existing checkpoint %s", final)
            old = final.with_name(final.name + ".replaced.tmp")
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        latest_tmp = self.folder / "latest.tmp"
        latest_tmp.write_text(f"{step}\n")
        os.replace(latest_tmp, self.folder / "latest")
        _fsync_dir(self.folder)
        self._prune()

    def _prune(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        for step in self.complete_steps()[:-k]:
            shutil.rmtree(self.step_dir(step))
            logger.info("pruned checkpoint %s (keep_latest_k=%d)", self.step_dir(step), k)

    # -- load

    def _clean_tmp(self) -> None:
        if not self.folder.is_dir():
            return
        for p in self.folder.iterdir():
            if p.name.endswith(".tmp"):
                logger.warning("removing leftover of an interrupted save: %s", p)
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink()

    def _choose_step(self) -> int:
        """Rank 0: the step to load (0 for none), after removing leftovers of crashed saves."""
        self._clean_tmp()
        steps = self.complete_steps()
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step={self.cfg.load_step} but {self.folder} has no complete "
                    f"step-{self.cfg.load_step}; complete steps: {steps or 'none'}. Set "
                    "checkpoint.load_step to one of them, or -1 for the newest"
                )
            return self.cfg.load_step
        return steps[-1] if steps else 0

    def load(self) -> int:
        """Resume from `cfg.load_step` or the newest complete checkpoint; returns its step.

        Returns 0 (states untouched) when checkpointing is disabled or there is none yet.
        """
        if not self.cfg.enable:
            return 0
        choice: int | str = 0
        if self.rank == 0:
            try:
                choice = self._choose_step()
            except CheckpointError as e:
                choice = str(e)  # tell the other ranks, so nobody waits forever
        choice = _broadcast_from_rank0(choice)
        if isinstance(choice, str):
            raise CheckpointError(choice)
        if choice == 0:
            logger.info("no checkpoint in %s: starting from step 0", self.folder)
            return 0
        path = self.step_dir(choice)
        self._check_compatible(path)
        begin = time.perf_counter()
        dcp.load(self._dcp_state(), checkpoint_id=str(path))
        _barrier()
        logger.info("loaded checkpoint %s in %.1f s", path, time.perf_counter() - begin)
        return choice

    def _check_compatible(self, path: Path) -> None:
        try:
            meta = json.loads((path / _META).read_text())
            saved_fp = json.loads((path / _FINGERPRINT).read_text())
        except FileNotFoundError as e:
            raise CheckpointError(
                f"rank {self.rank} cannot read {e.filename}, which rank 0 sees: the checkpoint "
                "folder (job.dump_folder) must be on a filesystem shared by all nodes"
            ) from None
        fix = (
            "Fix: run with the config this checkpoint was written with, or start a fresh run "
            "(a new job.run_name, or another job.dump_folder)."
        )
        diffs = fingerprint_mismatches(saved_fp, self.fingerprint)
        if diffs:
            raise CheckpointError(
                f"checkpoint {path} was written by a different configuration:\n  "
                + "\n  ".join(diffs)
                + f"\n{fix}"
            )
        missing = sorted(set(self.states) - set(meta["states"]))
        if missing:
            raise CheckpointError(
                f"checkpoint {path} has no state for {missing} (it holds {meta['states']}). {fix}"
            )
        wanted = self._per_rank_names()
        if wanted and meta["world_size"] != self.world_size:
            raise CheckpointError(
                f"checkpoint {path} was saved by {meta['world_size']} ranks but this run has "
                f"{self.world_size}: per-rank state {wanted} (data-loader position, RNG) cannot "
                f"be resharded. Resume with {meta['world_size']} ranks, or start a fresh run."
            )
        lacking = sorted(set(wanted) - set(meta["per_rank"]))
        if lacking:
            raise CheckpointError(f"checkpoint {path} has no per-rank state for {lacking}. {fix}")
