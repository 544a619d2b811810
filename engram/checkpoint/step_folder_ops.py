"""The folder of step folders: every path operation the checkpoint manager and its writer make.

Under `<run_folder>/<checkpoint.folder>/` (the format: folder.py): committed `step-<N>/`, a save
under way (or crashed) in `step-<N>.tmp/`, and `latest`. `StepFolders` lists, publishes (the
rename that commits a save), prunes and cleans up; it only ever removes folders and files with
this checkpointer's names (OWN_FILE_RE, plus the sub-folders of its folder states), and never a
checkpoint it cannot read. Every operation on the folder of step folders is here (as
torchtitan's `CheckpointStorage` gathers its manager's path operations); the files inside a
step folder are written by a save plan's parts (save_plan.py) and read by folder.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from engram.checkpoint.errors import CheckpointError
from engram.checkpoint.folder import (
    OWN_FILE_RE,
    STEP_TMP_RE,
    fsync_dir,
    read_manifest,
    remove_checkpoint,
    step_folders,
    verify_checkpoint,
)
from engram.checkpoint.table_delta import chain_of

logger = logging.getLogger("engram")


class StepFolders:
    """`folder`: `<run_folder>/<checkpoint.folder>`. Nothing here is collective: the manager
    and the writer say which rank calls what (rank 0 writes, renames and removes)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def steps(self) -> list[int]:
        """Steps with a `step-<N>/` folder, committed or not, ascending."""
        return step_folders(self.folder)

    def complete_steps(self) -> list[int]:
        """Steps with a committed checkpoint (manifest present, files present with the listed
        sizes; checksums are verified on load), ascending."""
        return [s for s in self.steps() if not verify_checkpoint(self.step_dir(s), False)]

    # -- a save's temporary folder

    def make_tmp(self, tmp: Path, dirs: Iterable[str]) -> None:
        """A fresh `step-<N>.tmp/` (a leftover of a crashed save of the step is removed)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            self.remove_own_tmp(tmp, dirs)
        tmp.mkdir()

    def remove_own_tmp(self, path: Path, dirs: Iterable[str]) -> None:
        """Remove a `step-<N>.tmp` folder only if every file in it has one of our names (`dirs`:
        the folder states' sub-folders)."""
        dirs = set(dirs)
        foreign = [
            p.name
            for p in path.iterdir()
            if not (p.is_file() and OWN_FILE_RE.match(p.name))
            and not (p.is_dir() and p.name in dirs)
        ]
        if foreign:
            raise CheckpointError(
                f"{path} looks like an interrupted save but holds files this checkpointer does "
                f"not write ({', '.join(sorted(foreign)[:5])}): not removing it. Move it away"
            )
        shutil.rmtree(path)

    def remove_partial(self, tmp: Path, dirs: Iterable[str]) -> None:
        """A failed save's `step-<N>.tmp/` (a warning if it cannot go). Rank 0 calls it."""
        if tmp.is_dir():
            try:
                self.remove_own_tmp(tmp, dirs)
            except (OSError, CheckpointError) as cleanup:
                logger.warning("could not remove partial checkpoint %s: %s", tmp, cleanup)

    def clean_tmp(self, dirs: Iterable[str]) -> None:
        """Remove leftovers of interrupted saves: only our own names (step-<N>.tmp, latest.tmp)."""
        if not self.folder.is_dir():
            return
        for p in self.folder.iterdir():
            if STEP_TMP_RE.match(p.name) and p.is_dir():
                try:
                    self.remove_own_tmp(p, dirs)
                    logger.warning("removed leftover of an interrupted save: %s", p)
                except CheckpointError as e:
                    logger.warning("%s", e)
            elif p.name == "latest.tmp" and p.is_file():
                p.unlink()

    # -- commit and prune

    def publish(self, step: int, tmp: Path, final: Path) -> None:
        """`tmp` (manifest written) becomes `final`, then `latest` says `step`. A checkpoint
        already at `final` that cannot be read is moved aside, never overwritten."""
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

    def prune(self, keep: int) -> None:
        """Remove intact checkpoints beyond the newest `keep` (0: none); never damaged ones,
        never a step the kept ones' table chains need."""
        if keep <= 0:
            return
        complete = self.complete_steps()
        needed = set(complete[-keep:])
        for step in complete[-keep:]:  # and every step their tables' chains need
            needed |= set(chain_of(read_manifest(self.step_dir(step)), step))
        for step in complete:
            if step in needed:
                continue
            remove_checkpoint(self.step_dir(step))
            logger.info("pruned checkpoint %s (keep_latest_k=%d)", self.step_dir(step), keep)
