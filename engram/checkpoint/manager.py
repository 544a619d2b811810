"""CheckpointManager: the training loop's save / async save / load / prune / resume.

A save writes into `step-<N>.tmp/`; after every rank has finished, rank 0 writes the manifest
(atomically, last) and renames the folder to `step-<N>/` (the format: folder.py). Load verifies
the manifest (every rank checksums a share of the files) and refuses a damaged or incomplete
checkpoint with the checkpoint, the file and the problem; `checkpoint.on_damaged = "previous"`
falls back to the newest intact one instead. A checkpoint that cannot be read is never
overwritten, pruned or deleted, and the run never silently starts from step 0 while checkpoints
exist. Cleanup only touches folders with this checkpointer's names and file names.

The manager decides when to save and which kind of save (a plan: save_plan.py, full or a table
delta); the writer (writer.py) carries out every plan; step_folder_ops.py holds the path
operations; resume.py the load's checks and reads.

JSON states (`per_rank`: the data loader) are stored per rank; when every rank saved the same
state (a global loader position) it loads at any world size, otherwise the world size must
match. RNG states are restored only at the same world size.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from engram.checkpoint import resume
from engram.checkpoint.collectives import (
    all_gather_objects,
    barrier,
    broadcast_from_rank0,
    get_rank,
    get_world_size,
)
from engram.checkpoint.errors import CheckpointError
from engram.checkpoint.folder import FORMAT
from engram.checkpoint.save_errors import describe_save_error
from engram.checkpoint.save_plan import SaveInputs, SavePlan, full_save, table_delta_save
from engram.checkpoint.state import ModelState, RNGState
from engram.checkpoint.step_folder_ops import StepFolders
from engram.checkpoint.table_delta import TableDeltas
from engram.checkpoint.writer import CheckpointWriter, PendingSave
from engram.config import Checkpoint
from engram.rowstore.host_worker import wait_host_work

logger = logging.getLogger("engram")

_RNG_KEY = resume.RNG_KEY
_NAME = re.compile(r"[A-Za-z0-9_]+")


def _check_states(states: dict[str, Any], folder_states: dict[str, Any]) -> None:
    for name, obj in states.items():
        if not callable(getattr(obj, "state_dict", None)) or not callable(
            getattr(obj, "load_state_dict", None)
        ):
            raise TypeError(
                f"checkpoint state {name!r} ({type(obj).__name__}) needs state_dict() and "
                "load_state_dict(): wrap it (ModelState, OptimizerState, TrainState)"
            )
        if name == _RNG_KEY or not _NAME.fullmatch(name):
            raise ValueError(
                f"checkpoint state name {name!r} is reserved or not [A-Za-z0-9_]+; rename it"
            )
    for name in folder_states:
        if name in states or not _NAME.fullmatch(name):
            raise ValueError(f"folder state name {name!r} is taken or not [A-Za-z0-9_]+")


class CheckpointManager:
    """Save every `cfg.interval` steps and at the last step; resume from the newest intact one.

    `states` maps names to Stateful objects (model, optimizer, lr_scheduler, dataloader,
    train_state, ...). Names in `per_rank` are stored as plain JSON per rank (their state_dict()
    must be JSON-serialisable: the data loader); this process's RNG state is added the same way
    when `save_rng` is set. `folder_states` maps names to objects that write and read their own
    files (`save(folder)` / `load(folder)`, collective) in sub-folder `<name>/` of the step folder
    (a DeepSpeed engine's checkpoint): listed in the same manifest and committed with the DCP
    shards. `tables` (the row-sparse Engram tables): with checkpoint.table_full_every > 1 the
    saves between full ones write only their touched rows (engram/checkpoint/table_delta.py).
    Every method is collective: call it on all ranks.
    """

    def __init__(
        self,
        cfg: Checkpoint,
        run_folder: Path,
        states: dict[str, Any],
        fingerprint: dict[str, Any],
        per_rank: Iterable[str] = ("dataloader",),
        save_rng: bool = True,
        data_meta: dict[str, int] | None = None,
        folder_states: dict[str, Any] | None = None,
        tables: TableDeltas | None = None,
    ):
        self.cfg = cfg
        # How the run consumes data ({"global_batch_samples": ..., "seq_len": ...}): stored in
        # meta.json; a resume that changes it is warned about (resume.warn_data_changed).
        self.data_meta = dict(data_meta or {})
        self.folder = Path(run_folder) / cfg.folder
        self.fingerprint = fingerprint
        self.per_rank = [k for k in per_rank if k in states]
        self.states = dict(states)
        self.folder_states = dict(folder_states or {})
        _check_states(self.states, self.folder_states)
        self.save_rng = save_rng
        self.rank = get_rank()
        self.world_size = get_world_size()
        self.folders = StepFolders(self.folder)
        self.writer = CheckpointWriter(self.folders, self.rank)
        self.last_saved_step: int | None = None
        self.loaded_step: int = 0
        self._pending: PendingSave | None = None
        self._async_group: Any = None
        self.tables = tables
        if cfg.table_full_every > 1 and tables is None:
            raise CheckpointError(
                f"checkpoint.table_full_every = {cfg.table_full_every} needs the model and "
                "optimizer states (their row-sparse Engram tables): set it to 1"
            )
        self.incremental = cfg.table_full_every > 1
        if self.incremental:
            tables.track()
        # The table chain (base step first) of the last save or load, and of the save under way.
        self._chain: list[int] | None = None
        self._saving_chain: list[int] | None = None

    # -- paths

    def step_dir(self, step: int) -> Path:
        return self.folders.step_dir(step)

    def complete_steps(self) -> list[int]:
        """Steps with a committed checkpoint (manifest present, files present with the listed
        sizes; checksums are verified on load), ascending."""
        return self.folders.complete_steps()

    def last_good_checkpoint(self) -> Path | None:
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    # -- the states

    def _dcp_state(self) -> dict[str, Any]:
        """A fresh dict per call: dcp.load replaces Stateful values in the dict it is given."""
        return {k: v for k, v in self.states.items() if k not in self.per_rank}

    def _json_states(self) -> dict[str, Any]:
        rng = {_RNG_KEY: RNGState()} if self.save_rng else {}
        return {**{k: self.states[k] for k in self.per_rank}, **rng}

    # -- save

    def should_save(self, step: int, last_step: bool = False) -> bool:
        return self.cfg.enable and step > 0 and (last_step or step % self.cfg.interval == 0)

    def maybe_save(self, step: int, last_step: bool = False, finite: bool = True) -> bool:
        """Save at every `interval` steps and at the last step; True if a checkpoint was written
        (or, with checkpoint.async_mode = "async", started; the last step's save is synchronous).

        `finite=False` (the step's update was skipped as non-finite): no save, so a save never
        prunes an older checkpoint because of such a step, and every checkpoint is one of a
        finite step (what the error messages call the last good checkpoint)."""
        if not self.should_save(step, last_step):
            return False
        if not finite:
            if self.rank == 0:
                logger.warning(
                    "step %d was skipped as non-finite: not saving a checkpoint at it (the older "
                    "checkpoints are kept)",
                    step,
                )
            return False
        self.save(step, blocking=last_step or self.cfg.async_mode != "async")
        return True

    def _check_finite(self, step: int) -> None:
        wait_host_work()  # host tables: the queued updates write the rows this reads
        local_ok = all(s.all_finite() for s in self.states.values() if isinstance(s, ModelState))
        if not all(all_gather_objects(local_ok)):
            good = self.last_good_checkpoint()
            raise CheckpointError(
                f"refusing to save step {step}: the model holds non-finite values (NaN/inf). "
                f"The last good checkpoint is {good or 'none'}; resume from it with a lower "
                "optimizer.lr or a clipping norm (training.max_norm)"
            )

    def save(self, step: int, blocking: bool = True) -> Path:
        """Write checkpoint `step`. `blocking=False`: DCP writes in a background thread and the
        checkpoint is committed by the next save() or wait(); a crash before that leaves only a
        `step-<N>.tmp/` folder (not a checkpoint) and the previous checkpoints intact."""
        begin = time.perf_counter()
        self._check_finite(step)
        self.wait()  # the previous (async) save is committed before a new one starts
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        try:
            if not self._save_into(step, tmp, final, blocking):
                logger.info(
                    "checkpoint step-%d staged in %.1f s; writing in the background",
                    step,
                    time.perf_counter() - begin,
                )
                return final
        except CheckpointError:
            # Raised on every rank at once (raise_if_any_rank_failed): no rank writes into tmp
            # any more, so its partial folder goes now, not at the next start.
            self.writer.remove_partial(tmp, set(self.folder_states))
            raise
        except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException
            # Described first: removing the partial save frees the space a full disk lacked.
            message = describe_save_error(self.folder, step, tmp, e)
            self.writer.remove_partial(tmp, set(self.folder_states))
            raise CheckpointError(message) from e
        self._chain = self._saving_chain
        if self.rank == 0:
            logger.info(
                "saved checkpoint %s (%.1f MiB) in %.1f s",
                final,
                self.writer.last_size / 2**20,
                time.perf_counter() - begin,
            )
        self.last_saved_step = step
        return final

    def wait(self) -> None:
        """Finish a pending async save: wait for DCP, then verify and commit it (collective)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        self.writer.finish(pending)
        if self.rank == 0:
            logger.info(
                "committed checkpoint %s (%.1f MiB), %.1f s after it was started",
                pending.final,
                self.writer.last_size / 2**20,
                time.perf_counter() - pending.begin,
            )
        self._chain = self._saving_chain
        self.last_saved_step = pending.plan.step

    def _save_into(self, step: int, tmp: Path, final: Path, blocking: bool = True) -> bool:
        """Returns True when the checkpoint is committed, False when an async save is pending."""
        self.writer.open(step, tmp, set(self.folder_states))
        plan = self._plan(step, blocking)
        self._saving_chain = plan.chain
        self._chain = None  # until this save is committed: a failed one makes the next full
        self._pending = self.writer.write(plan, tmp, final)
        return self._pending is None

    def _plan(self, step: int, blocking: bool) -> SavePlan:
        """A table delta while the chain since the last full save is shorter than
        checkpoint.table_full_every, else a full save."""
        inputs = SaveInputs(
            dcp_state=self._dcp_state(),
            json_states=self._json_states(),
            folder_states=dict(self.folder_states),
            meta={
                "format": FORMAT,
                "world_size": self.world_size,
                "json_states": list(self._json_states()),
                "states": sorted([*self.states, *self.folder_states]),
                "torch_version": torch.__version__,
                "data": self.data_meta,
            },
            fingerprint=self.fingerprint,
            keep=self.cfg.keep_latest_k,
            async_group=self._background_group,
            tables=self.tables if self.incremental else None,
        )
        chain = self._chain
        if self.incremental and chain is not None and len(chain) < self.cfg.table_full_every:
            return table_delta_save(step, inputs, blocking, chain)
        return full_save(step, inputs, blocking)

    def _background_group(self) -> Any:
        """An async save's process group: its own gloo group, so the background thread's
        collectives do not interleave with the training loop's on the default group."""
        if self._async_group is None and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    # -- load

    def load(self) -> int:
        """Resume from `cfg.load_step` or the newest intact checkpoint; returns its step.

        Returns 0 (states untouched) when checkpointing is disabled, there is no checkpoint
        yet, or `checkpoint.load_step = 0`."""
        if not self.cfg.enable:
            return 0
        choice: list[int] | str = []
        if self.rank == 0:
            try:
                choice = resume.candidates(self.folders, self.cfg, set(self.folder_states))
            except CheckpointError as e:
                choice = str(e)  # tell the other ranks, so nobody waits forever
        choice = broadcast_from_rank0(choice)
        if isinstance(choice, str):
            raise CheckpointError(choice)
        if not choice:
            logger.info("no checkpoint to load in %s: starting from step 0", self.folder)
            return 0
        step, path = resume.choose(self.folders, self.cfg, choice)
        meta = resume.check_compatible(
            path,
            self.fingerprint,
            set(self.states) | set(self.folder_states),
            list(self._json_states()),
            self.rank,
        )
        resume.warn_data_changed(path, meta.get("data", {}), self.data_meta, self.rank)
        begin = time.perf_counter()
        for name, obj in self.folder_states.items():  # first: they refuse what they cannot load
            obj.load(path / name)
        try:
            self._chain = resume.load_dcp(self.folders, path, step, self._dcp_state, self.tables)
        except (Exception, dcp.CheckpointException) as e:  # name the checkpoint, not just DCP
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(
                f"checkpoint {path} passed its manifest check but DCP could not load it into "
                f"this run: {type(e).__name__}: {e}"
            ) from e
        resume.load_json_states(path, meta, self._json_states(), self.rank, self.world_size)
        barrier()
        logger.info("loaded checkpoint %s in %.1f s", path, time.perf_counter() - begin)
        self.loaded_step = step
        return step
