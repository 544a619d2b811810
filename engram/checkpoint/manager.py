"""CheckpointManager: the training loop's save / async save / load / prune / resume.

A save writes into `step-<N>.tmp/`; after every rank has finished, rank 0 writes the manifest
(atomically, last) and renames the folder to `step-<N>/` (the format: folder.py). Load verifies
the manifest (every rank checksums a share of the files) and refuses a damaged or incomplete
checkpoint with the checkpoint, the file and the problem; `checkpoint.on_damaged = "previous"`
falls back to the newest intact one instead. A checkpoint that cannot be read is never
overwritten, pruned or deleted, and the run never silently starts from step 0 while checkpoints
exist. Cleanup only touches folders with this checkpointer's names and file names.

JSON states (`per_rank`: the data loader) are stored per rank; when every rank saved the same
state (a global loader position) it loads at any world size, otherwise the world size must
match. RNG states are restored only at the same world size.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from engram.checkpoint.collectives import (
    all_gather_objects,
    barrier,
    broadcast_from_rank0,
    get_rank,
    get_world_size,
    raise_if_any_rank_failed,
)
from engram.checkpoint.dcp_io import TensorsOnlySavePlanner, dcp_load
from engram.checkpoint.errors import CheckpointError
from engram.checkpoint.folder import (
    FINGERPRINT_FILE,
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    OWN_FILE_RE,
    STEP_TMP_RE,
    collective_checksums,
    file_checksum,
    fingerprint_mismatches,
    fsync_dir,
    manifest_crc,
    manifest_entry,
    read_manifest,
    remove_checkpoint,
    step_folders,
    verify_checkpoint,
    write_json,
    write_manifest,
)
from engram.checkpoint.save_errors import describe_save_error
from engram.checkpoint.state import ModelState, RNGState
from engram.checkpoint.streamed_dcp import StreamedLoadPlanner, StreamedSavePlanner, StreamedWriter
from engram.checkpoint.table_delta import (
    CHAIN_KEY,
    TableDeltas,
    chain_of,
    chain_problems,
    chain_record,
)
from engram.config import Checkpoint
from engram.rowstore.host_worker import wait_host_work
from engram.rowstore.streamed_columns import streamed_columns

logger = logging.getLogger("engram")

_RNG_KEY = "rng"


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
        # meta.json; a resume that changes it is warned about (_warn_data_changed).
        self.data_meta = dict(data_meta or {})
        self.folder = Path(run_folder) / cfg.folder
        self.fingerprint = fingerprint
        self.per_rank = [k for k in per_rank if k in states]
        for name, obj in states.items():
            if not callable(getattr(obj, "state_dict", None)) or not callable(
                getattr(obj, "load_state_dict", None)
            ):
                raise TypeError(
                    f"checkpoint state {name!r} ({type(obj).__name__}) needs state_dict() and "
                    "load_state_dict(): wrap it (ModelState, OptimizerState, TrainState)"
                )
            if name == _RNG_KEY or not re.fullmatch(r"[A-Za-z0-9_]+", name):
                raise ValueError(
                    f"checkpoint state name {name!r} is reserved or not [A-Za-z0-9_]+; rename it"
                )
        self.states = dict(states)
        self.folder_states = dict(folder_states or {})
        for name in self.folder_states:
            if name in self.states or not re.fullmatch(r"[A-Za-z0-9_]+", name):
                raise ValueError(f"folder state name {name!r} is taken or not [A-Za-z0-9_]+")
        self.save_rng = save_rng
        self.rank = get_rank()
        self.world_size = get_world_size()
        self.last_saved_step: int | None = None
        self.loaded_step: int = 0
        self._pending: tuple[int, Path, Path, Any, float] | None = None
        self._async_group: Any = None
        self._last_size = 0
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
        return self.folder / f"step-{step}"

    def _step_folders(self) -> list[int]:
        return step_folders(self.folder)

    def complete_steps(self) -> list[int]:
        """Steps with a committed checkpoint (manifest present, files present with the listed
        sizes; checksums are verified on load), ascending."""
        return [s for s in self._step_folders() if not verify_checkpoint(self.step_dir(s), False)]

    def last_good_checkpoint(self) -> Path | None:
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    # -- state dict assembly

    def _dcp_state(self) -> dict[str, Any]:
        """A fresh dict per call: dcp.load replaces Stateful values in the dict it is given."""
        return {k: v for k, v in self.states.items() if k not in self.per_rank}

    def _json_names(self) -> list[str]:
        return self.per_rank + ([_RNG_KEY] if self.save_rng else [])

    def _json_state(self, name: str) -> Any:
        return RNGState() if name == _RNG_KEY else self.states[name]

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
            self._remove_partial(tmp)
            raise
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise self._save_failed(step, tmp, e) from e
        self._chain = self._saving_chain
        if self.rank == 0:
            logger.info(
                "saved checkpoint %s (%.1f MiB) in %.1f s",
                final,
                self._last_size / 2**20,
                time.perf_counter() - begin,
            )
        self.last_saved_step = step
        return final

    def wait(self) -> None:
        """Finish a pending async save: wait for DCP, then verify and commit it (collective)."""
        if self._pending is None:
            return
        step, tmp, final, future, begin = self._pending
        self._pending = None
        error = None
        try:
            future.result()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error = describe_save_error(self.folder, step, tmp, e)
        try:
            raise_if_any_rank_failed(error)
            self._commit_collective(step, tmp, final)
        except CheckpointError:
            self._remove_partial(tmp)
            raise
        if self.rank == 0:
            logger.info(
                "committed checkpoint %s (%.1f MiB), %.1f s after it was started",
                final,
                self._last_size / 2**20,
                time.perf_counter() - begin,
            )
        self._chain = self._saving_chain
        self.last_saved_step = step

    def _save_into(self, step: int, tmp: Path, final: Path, blocking: bool = True) -> bool:
        """Returns True when the checkpoint is committed, False when an async save is pending."""
        error = None
        if self.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # left by a crashed save of this step
                    self._remove_own_tmp(tmp)
                tmp.mkdir()
            except (OSError, CheckpointError) as e:
                error = describe_save_error(self.folder, step, tmp, e)
        raise_if_any_rank_failed(error)
        future = None
        delta = (
            self.incremental
            and self._chain is not None
            and len(self._chain) < self.cfg.table_full_every
        )
        self._saving_chain = [*self._chain, step] if delta else [step]
        self._chain = None  # until this save is committed: a failed one makes the next full
        dcp_state = self.tables.without_tables(self._dcp_state()) if delta else self._dcp_state()
        if blocking:
            # NVMe tables' columns stream from their stores one chunk at a time (streamed_dcp.py)
            with streamed_columns():
                dcp.save(dcp_state, storage_writer=StreamedWriter(str(tmp)),
                         planner=StreamedSavePlanner())  # fmt: skip
        else:
            # An async save copies the state dict to host memory before it returns (the
            # training step may change it then): NVMe tables' columns are read out whole.
            if self._async_group is None and dist.is_initialized():
                # Its own gloo group: the background thread's collectives must not interleave
                # with the training loop's on the default group.
                self._async_group = dist.new_group(backend="gloo")
            response = dcp.async_save(
                dcp_state,
                checkpoint_id=str(tmp),
                process_group=self._async_group,
                planner=TensorsOnlySavePlanner(),
            )
            future = getattr(response, "upload_completion", response)
        for name, obj in self.folder_states.items():
            obj.save(tmp / name)
        error = None
        try:
            if delta:
                self.tables.write_delta(tmp, self.rank)
            elif self.incremental:
                self.tables.reset()
            for name in self._json_names():
                state = self._json_state(name).state_dict()
                write_json(tmp / f"{name}.rank{self.rank}.json", state)
        except OSError as e:
            error = describe_save_error(self.folder, step, tmp, e)
        except TypeError as e:
            error = f"checkpoint state {name!r} is not JSON-serialisable: {e}"
        raise_if_any_rank_failed(error)  # also the barrier: every rank's files are on disk
        if future is not None:
            self._pending = (step, tmp, final, future, time.perf_counter())
            return False
        self._commit_collective(step, tmp, final)
        return True

    def _commit_collective(self, step: int, tmp: Path, final: Path) -> None:
        names = broadcast_from_rank0(
            sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
            if self.rank == 0
            else None
        )
        checksums = collective_checksums(tmp, names)
        error = None
        if self.rank == 0:
            try:
                self._commit(step, tmp, final, checksums)
            except (OSError, CheckpointError) as e:
                error = describe_save_error(self.folder, step, tmp, e)
        raise_if_any_rank_failed(error)

    def _save_failed(self, step: int, tmp: Path, e: BaseException) -> CheckpointError:
        """A save raised (on any rank): remove our partial folder, report the path and why."""
        # Described first: removing the partial save frees the space a full disk lacked.
        message = describe_save_error(self.folder, step, tmp, e)
        self._remove_partial(tmp)
        return CheckpointError(message)

    def _remove_partial(self, tmp: Path) -> None:
        """Rank 0 removes a failed save's step-<N>.tmp/ (a warning if it cannot)."""
        if self.rank == 0 and tmp.is_dir():
            try:
                self._remove_own_tmp(tmp)
            except (OSError, CheckpointError) as cleanup:
                logger.warning("could not remove partial checkpoint %s: %s", tmp, cleanup)

    def _commit(self, step: int, tmp: Path, final: Path, checksums: dict[str, Any]) -> None:
        meta = {
            "format": FORMAT,
            "step": step,
            "world_size": self.world_size,
            "json_states": self._json_names(),
            "states": sorted([*self.states, *self.folder_states]),
            "torch_version": torch.__version__,
            "time": time.time(),
            "data": self.data_meta,
        }
        write_json(tmp / FINGERPRINT_FILE, self.fingerprint)
        write_json(tmp / META_FILE, meta)
        files = {}
        for name, got in checksums.items():
            if isinstance(got, str):
                raise OSError(f"{tmp / name} {got}")
            files[name] = {"size": got[0], "crc32": got[1]}
        for name in (FINGERPRINT_FILE, META_FILE):
            files[name] = manifest_entry(tmp / name)
        self._last_size = sum(f["size"] for f in files.values())
        manifest = {"format": FORMAT, "step": step, "files": files}
        if self.incremental:
            manifest[CHAIN_KEY] = chain_record(
                self._saving_chain, lambda s: file_checksum(self.step_dir(s) / MANIFEST_FILE)
            )
        write_manifest(tmp, manifest)
        if final.exists():
            problems = verify_checkpoint(final, collective=False)
            if problems:
                # Never overwrite what could not be read: keep it aside for inspection.
                aside = final.with_name(f"{final.name}.unreadable-{int(time.time())}")
                logger.error(
                    "checkpoint %s could not be read (%s); moved to %s, not overwritten",
                    final,
                    problems[0],
                    aside,
                )
                os.rename(final, aside)
                os.rename(tmp, final)
            else:
                # Re-saving a step (resumed from an older checkpoint): the new history wins.
                logger.warning("replacing existing checkpoint %s", final)
                old = final.with_name(final.name + ".tmp.replaced")
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        latest_tmp = self.folder / "latest.tmp"
        latest_tmp.write_text(f"{step}\n")
        os.replace(latest_tmp, self.folder / "latest")
        fsync_dir(self.folder)
        self._prune()

    def _prune(self) -> None:
        """Remove intact checkpoints beyond the newest keep_latest_k; never damaged ones."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        complete = self.complete_steps()
        needed = set(complete[-k:])
        for step in complete[-k:]:  # and every step their tables' chains need
            needed |= set(chain_of(read_manifest(self.step_dir(step)), step))
        for step in complete:
            if step in needed:
                continue
            remove_checkpoint(self.step_dir(step))
            logger.info("pruned checkpoint %s (keep_latest_k=%d)", self.step_dir(step), k)

    # -- load

    def _remove_own_tmp(self, path: Path) -> None:
        """Remove a `step-<N>.tmp` folder only if every file in it has one of our names."""
        foreign = [
            p.name
            for p in path.iterdir()
            if not (p.is_file() and OWN_FILE_RE.match(p.name))
            and not (p.is_dir() and p.name in self.folder_states)
        ]
        if foreign:
            raise CheckpointError(
                f"{path} looks like an interrupted save but holds files this checkpointer does "
                f"not write ({', '.join(sorted(foreign)[:5])}): not removing it. Move it away"
            )
        shutil.rmtree(path)

    def _clean_tmp(self) -> None:
        """Remove leftovers of interrupted saves: only our own names (step-<N>.tmp, latest.tmp)."""
        if not self.folder.is_dir():
            return
        for p in self.folder.iterdir():
            if STEP_TMP_RE.match(p.name) and p.is_dir():
                try:
                    self._remove_own_tmp(p)
                    logger.warning("removed leftover of an interrupted save: %s", p)
                except CheckpointError as e:
                    logger.warning("%s", e)
            elif p.name == "latest.tmp" and p.is_file():
                p.unlink()

    def _candidates(self) -> list[int]:
        """Rank 0: the steps to try, newest first; [] for a fresh start."""
        self._clean_tmp()
        steps = self._step_folders()
        if self.cfg.load_step == 0:
            if steps:
                logger.warning(
                    "checkpoint.load_step = 0: starting from step 0 although %s holds "
                    "checkpoints %s (they are kept)",
                    self.folder,
                    steps,
                )
            return []
        if self.cfg.load_step > 0:
            if self.cfg.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step={self.cfg.load_step} but {self.folder} has no "
                    f"step-{self.cfg.load_step}; checkpoints: {steps or 'none'}. Set "
                    "checkpoint.load_step to one of them, -1 for the newest, or 0 to start fresh"
                )
            return [self.cfg.load_step]
        return steps[::-1]

    def load(self) -> int:
        """Resume from `cfg.load_step` or the newest intact checkpoint; returns its step.

        Returns 0 (states untouched) when checkpointing is disabled, there is no checkpoint
        yet, or `checkpoint.load_step = 0`."""
        if not self.cfg.enable:
            return 0
        choice: list[int] | str = []
        if self.rank == 0:
            try:
                choice = self._candidates()
            except CheckpointError as e:
                choice = str(e)  # tell the other ranks, so nobody waits forever
        choice = broadcast_from_rank0(choice)
        if isinstance(choice, str):
            raise CheckpointError(choice)
        if not choice:
            logger.info("no checkpoint to load in %s: starting from step 0", self.folder)
            return 0
        damaged: list[str] = []
        for step in choice:
            path = self.step_dir(step)
            problems = verify_checkpoint(path) or self._chain_problems(path)
            if not problems:
                break
            damaged.append(f"{path}:\n    " + "\n    ".join(problems))
            if self.cfg.on_damaged == "error" or self.cfg.load_step > 0:
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
        else:
            raise CheckpointError(
                f"{self.folder} holds checkpoints but none is intact:\n  "
                + "\n  ".join(damaged)
                + "\nRefusing to start from step 0 over them. Fix: restore the files, or set "
                "checkpoint.load_step = 0 to start fresh (the damaged checkpoints are kept), or "
                "use another checkpoint.folder"
            )
        meta = self._check_compatible(path)
        self._warn_data_changed(path, meta.get("data", {}))
        begin = time.perf_counter()
        for name, obj in self.folder_states.items():  # first: they refuse what they cannot load
            obj.load(path / name)
        try:
            self._load_dcp(path, step)
        except (Exception, CheckpointException) as e:  # name the checkpoint, not just DCP
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(
                f"checkpoint {path} passed its manifest check but DCP could not load it into "
                f"this run: {type(e).__name__}: {e}"
            ) from e
        self._load_json_states(path, meta)
        barrier()
        logger.info("loaded checkpoint %s in %.1f s", path, time.perf_counter() - begin)
        self.loaded_step = step
        return step

    def _chain_problems(self, path: Path) -> list[str]:
        """Problems of the steps a table delta at `path` needs (collective, like verify)."""
        return chain_problems(
            path, read_manifest(path), self.step_dir, manifest_crc, verify_checkpoint
        )

    def _load_dcp(self, path: Path, step: int) -> None:
        """The DCP state of `path`: for a table delta, the base's, then the deltas replayed,
        then the step's own DCP part (everything but the tables)."""
        chain = chain_of(read_manifest(path), step)
        if len(chain) > 1:
            if self.tables is None:  # (a pipeline stage may hold no table: it has none)
                raise CheckpointError(
                    f"checkpoint {path} holds its tables as deltas on step-{chain[0]} but this "
                    "run has no row-sparse Engram tables to replay them into"
                )
            with streamed_columns():  # NVMe tables load chunk by chunk (streamed_dcp.py)
                dcp_load(self._dcp_state(), self.step_dir(chain[0]), planner=StreamedLoadPlanner())
            for s in chain[1:]:
                saved = json.loads((self.step_dir(s) / META_FILE).read_text())["world_size"]
                self.tables.apply(self.step_dir(s), int(saved))
            dcp_load(self.tables.without_tables(self._dcp_state()), path)
        else:
            with streamed_columns():
                dcp_load(self._dcp_state(), path, planner=StreamedLoadPlanner())
        if self.tables is not None:
            self.tables.reset()
        self._chain = chain

    def _load_json_states(self, path: Path, meta: dict[str, Any]) -> None:
        saved_world = int(meta["world_size"])
        for name in self._json_names():
            states = []
            for k in range(saved_world):
                try:
                    states.append(json.loads((path / f"{name}.rank{k}.json").read_text()))
                except (OSError, ValueError) as e:
                    raise CheckpointError(
                        f"checkpoint {path}: {name}.rank{k}.json cannot be read: {e}"
                    ) from None
            if all(s == states[0] for s in states):
                self._json_state(name).load_state_dict(states[0])  # global: any world size
            elif saved_world == self.world_size:
                self._json_state(name).load_state_dict(states[self.rank])
            elif name == _RNG_KEY:
                if self.rank == 0:
                    logger.warning(
                        "checkpoint %s was saved by %d ranks, this run has %d: the per-rank RNG "
                        "states are not restored",
                        path,
                        saved_world,
                        self.world_size,
                    )
            else:
                raise CheckpointError(
                    f"checkpoint {path} was saved by {saved_world} ranks but this run has "
                    f"{self.world_size}, and its {name!r} state differs between ranks (a "
                    f"per-rank position), so it cannot be resharded. Resume with {saved_world} "
                    "ranks, or use a loader whose state is global (the same on every rank)"
                )

    def _warn_data_changed(self, path: Path, saved: dict[str, Any]) -> None:
        changed = {
            k: (saved[k], v) for k, v in self.data_meta.items() if k in saved and saved[k] != v
        }
        if changed and self.rank == 0:
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

    def _check_compatible(self, path: Path) -> dict[str, Any]:
        try:
            meta = json.loads((path / META_FILE).read_text())
            saved_fp = json.loads((path / FINGERPRINT_FILE).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"rank {self.rank} cannot read {getattr(e, 'filename', None) or path}: {e}. "
                "On several nodes the checkpoint folder (job.dump_folder) must be on a "
                "filesystem shared by all nodes"
            ) from None
        fix = (
            "Nothing was changed in the run folder. Fix: run with the config this checkpoint "
            "was written with, or start a fresh run (a new job.run_name, or another "
            "job.dump_folder)."
        )
        diffs = fingerprint_mismatches(saved_fp, self.fingerprint)
        if diffs:
            raise CheckpointError(
                f"checkpoint {path} was written by a different configuration:\n  "
                + "\n  ".join(diffs)
                + f"\n{fix}"
            )
        missing = sorted((set(self.states) | set(self.folder_states)) - set(meta["states"]))
        if missing:
            raise CheckpointError(
                f"checkpoint {path} has no state for {missing} (it holds {meta['states']}). {fix}"
            )
        lacking = sorted(set(self._json_names()) - set(meta.get("json_states", [])))
        if lacking:
            raise CheckpointError(f"checkpoint {path} has no state for {lacking}. {fix}")
        return meta
