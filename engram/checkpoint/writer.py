"""The one writer every save plan goes through (save_plan.py says what a plan holds).

    open     rank 0 makes `step-<N>.tmp/` (a crashed save's leftover of ours removed first);
             every rank raises if it could not
    write    the plan's shared parts (DCP, folder states), then its local parts (per-rank
             files), their errors gathered so every rank raises together; then the commit, or,
             when a part finishes in the background (an async save), a `PendingSave`
    finish   a pending save: wait for its future, then commit
    commit   every rank checksums a share of the files; rank 0 writes fingerprint.json,
             meta.json and the manifest (last, atomically), renames the folder to `step-<N>/`,
             updates `latest` and prunes (step_folder_ops.py)

Every call is collective: all ranks, in the same order. A failure raises CheckpointError on
every rank with the path and why (save_errors.py: a full disk names the free and needed bytes);
the caller removes the partial folder.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engram.checkpoint.collectives import broadcast_from_rank0, raise_if_any_rank_failed
from engram.checkpoint.errors import CheckpointError
from engram.checkpoint.folder import (
    FINGERPRINT_FILE,
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    collective_checksums,
    file_checksum,
    manifest_entry,
    write_json,
    write_manifest,
)
from engram.checkpoint.save_errors import describe_save_error
from engram.checkpoint.save_plan import SavePlan
from engram.checkpoint.step_folder_ops import StepFolders
from engram.checkpoint.table_delta import CHAIN_KEY, chain_record


@dataclass
class PendingSave:
    """A save whose files are still being written in the background."""

    plan: SavePlan
    tmp: Path
    final: Path
    futures: list[Future]
    begin: float  # time.perf_counter() when the parts were handed over


class CheckpointWriter:
    """Carries out save plans in `folders` for this rank (the module docstring)."""

    def __init__(self, folders: StepFolders, rank: int) -> None:
        self.folders, self.rank = folders, rank
        self.last_size = 0  # bytes of the last committed checkpoint (its manifest's files)

    def open(self, step: int, tmp: Path, dirs: set[str] | frozenset[str]) -> None:
        """Rank 0 makes `tmp` (`dirs`: sub-folders a leftover of ours may hold)."""
        error = None
        if self.rank == 0:
            try:
                self.folders.make_tmp(tmp, dirs)
            except (OSError, CheckpointError) as e:
                error = describe_save_error(self.folders.folder, step, tmp, e)
        raise_if_any_rank_failed(error)

    def write(self, plan: SavePlan, tmp: Path, final: Path) -> PendingSave | None:
        """The plan's parts into `tmp` (opened), then the commit; a PendingSave instead when a
        part finishes in the background."""
        futures = [f for part in plan.shared if (f := part.write(tmp, self.rank)) is not None]
        error = None
        try:
            for part in plan.local:
                part.write(tmp, self.rank)
        except OSError as e:
            error = describe_save_error(self.folders.folder, plan.step, tmp, e)
        except TypeError as e:  # a JSON state that is not JSON (JsonStates names it)
            error = str(e)
        raise_if_any_rank_failed(error)  # also the barrier: every rank's files are on disk
        if futures:
            return PendingSave(plan, tmp, final, futures, time.perf_counter())
        self.commit(plan, tmp, final)
        return None

    def finish(self, pending: PendingSave) -> None:
        """Wait for a pending save's background writes, then commit it."""
        plan, tmp = pending.plan, pending.tmp
        error = None
        try:
            for future in pending.futures:
                future.result()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error = describe_save_error(self.folders.folder, plan.step, tmp, e)
        try:
            raise_if_any_rank_failed(error)
            self.commit(plan, tmp, pending.final)
        except CheckpointError:
            self.remove_partial(tmp, plan.dirs)
            raise

    def commit(self, plan: SavePlan, tmp: Path, final: Path) -> None:
        names = broadcast_from_rank0(
            sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
            if self.rank == 0
            else None
        )
        checksums = collective_checksums(tmp, names)
        error = None
        if self.rank == 0:
            try:
                self._record(plan, tmp, checksums)
                self.folders.publish(plan.step, tmp, final)
                self.folders.prune(plan.keep)
            except (OSError, CheckpointError) as e:
                error = describe_save_error(self.folders.folder, plan.step, tmp, e)
        raise_if_any_rank_failed(error)

    def _record(self, plan: SavePlan, tmp: Path, checksums: dict[str, Any]) -> None:
        """fingerprint.json, meta.json, then the manifest (size + CRC-32 of every file)."""
        write_json(tmp / FINGERPRINT_FILE, plan.fingerprint)
        write_json(tmp / META_FILE, {**plan.meta, "time": time.time()})
        files = {}
        for name, got in checksums.items():
            if isinstance(got, str):
                raise OSError(f"{tmp / name} {got}")
            files[name] = {"size": got[0], "crc32": got[1]}
        for name in (FINGERPRINT_FILE, META_FILE):
            files[name] = manifest_entry(tmp / name)
        self.last_size = sum(f["size"] for f in files.values())
        manifest = {"format": FORMAT, "step": plan.step, "files": files}
        if plan.record_chain:
            step_dir = self.folders.step_dir
            manifest[CHAIN_KEY] = chain_record(
                plan.chain, lambda s: file_checksum(step_dir(s) / MANIFEST_FILE)
            )
        write_manifest(tmp, manifest)

    def remove_partial(self, tmp: Path, dirs: set[str] | frozenset[str]) -> None:
        """Rank 0 removes a failed save's step-<N>.tmp/ (a warning if it cannot)."""
        if self.rank == 0:
            self.folders.remove_partial(tmp, dirs)
