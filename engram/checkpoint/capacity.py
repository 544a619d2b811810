"""What a run's checkpoints need of disk and host memory: the rules, stated once for the memory
planner (planner/table_checkpoint.py, per node, planned) and the run's start-up checks
(runner/start_checks.py, from the model as placed and the folder's free space).

- Incremental table checkpoints (checkpoint.table_full_every = f > 1, table_delta.py): a save
  interval of I steps touches u x (1 + (I - 1) x (1 - reuse_window)) rows of a shard that a step
  touches u of (`touched_rows`, at most the shard; reuse as measured, docs/host_tables.md), and
  each saved row carries an int64 id.
- The folder at its fullest (`kept_checkpoint_bytes`): a save is committed before the oldest
  checkpoint is pruned (manager.py `_prune`), so keep_latest_k + 1 checkpoints, plus the full
  save (base) each kept delta's chain needs; the saves run full, f - 1 deltas, full, ...
- Host memory of an asynchronous save (`async_save_host_problem`): DCP stages a copy of this
  rank's state in host memory; NVMe tables are read out of their page files whole for it
  (a synchronous save streams them a chunk at a time instead: streamed_dcp.py).
"""

from __future__ import annotations

from engram.runtime.filesystems import size_text

__all__ = [
    "ROW_ID_BYTES",
    "async_save_host_problem",
    "checkpoint_space_problem",
    "kept_checkpoint_bytes",
    "touched_rows",
]

ROW_ID_BYTES = 8


def touched_rows(per_step: int, interval: int, reuse_window: float, local_rows: int) -> int:
    """Distinct rows of one shard touched over `interval` steps (see the module docstring)."""
    return min(local_rows, round(per_step * (1 + (interval - 1) * (1 - reuse_window))))


def kept_checkpoint_bytes(
    full_bytes: int, delta_bytes: int, keep_latest_k: int, table_full_every: int, saves: int
) -> int:
    """The most bytes the checkpoint folder holds over a run that writes `saves` checkpoints
    (full saves of `full_bytes`, deltas of `delta_bytes`, a full one every `table_full_every`):
    at each save, the checkpoints kept before it (the newest keep_latest_k and their chains'
    bases; all of them with keep_latest_k = 0) plus the new one."""
    f = max(1, table_full_every)
    if keep_latest_k <= 0:  # nothing is pruned: every save stays
        fulls = -(-saves // f)
        return fulls * full_bytes + (saves - fulls) * delta_bytes
    size = lambda i: full_bytes if i % f == 0 else delta_bytes  # noqa: E731
    peak = 0
    for new in range(min(saves, keep_latest_k + 2 * f)):  # periodic from then on
        kept = range(max(0, new - keep_latest_k), new)
        held = set(kept) | {i - i % f for i in kept}  # and their chains' bases
        peak = max(peak, size(new) + sum(size(i) for i in held))
    return peak


def checkpoint_space_problem(need: int, free: int, folder: str, keep_latest_k: int) -> str | None:
    """The checkpoints a run will hold (`need` bytes) against the `free` bytes of its folder:
    the problem, naming both and the fix, or None."""
    if need <= free:
        return None
    keep = f"keep_latest_k = {keep_latest_k}" if keep_latest_k > 0 else "keep_latest_k = 0 (all)"
    return (
        f"checkpoint disk: the checkpoints this run keeps ({keep}, one more while a save "
        f"commits) need {size_text(need)}, {folder} has {size_text(free)} free: free "
        "space, point checkpoint.folder / job.dump_folder at a bigger drive, lower "
        "checkpoint.keep_latest_k, or save tables incrementally (checkpoint.table_full_every)"
    )


def async_save_host_problem(
    save_host_bytes: int, other_host_bytes: int, host_bytes: int, source: str
) -> str | None:
    """checkpoint.async_mode = "async": the state it holds in host memory (`save_host_bytes`:
    the staging copy, NVMe tables read out whole) next to what the run keeps there anyway
    (`other_host_bytes`: host tables, NVMe caches), against `host_bytes` (`source` names where
    that figure came from): the problem, or None."""
    if not host_bytes or save_host_bytes + other_host_bytes <= host_bytes:
        return None
    return (
        f'checkpoint host memory: checkpoint.async_mode = "async" holds '
        f"{size_text(save_host_bytes)} per node at a save (a staging copy of the state; NVMe "
        f"tables read out of their page files whole) next to the {size_text(other_host_bytes)} "
        f"the run keeps in host memory (host tables, NVMe caches), more than the "
        f"{size_text(host_bytes)} of host memory ({source}): set "
        'checkpoint.async_mode = "disabled" (a synchronous save streams NVMe tables chunk by '
        "chunk and stages nothing)"
    )
