"""Engram table checkpoint bytes and time per save: full (every row and its optimizer state) vs
incremental (the rows touched since the previous save, with their row ids).

Full: a rank's shards as DCP saves them, fp32 weight + state columns per row (`record_bytes`).
Incremental: the rows a save interval of I steps touches per table and rank, from the measured
reuse (docs/host_tables.md): a step touches u rows, of which `reuse_window` were touched in the
last few steps, so I steps touch u x (1 + (I - 1) x (1 - reuse_window)) rows, at most the shard;
each saved row carries an int64 id. Time: bytes per node / --checkpoint_write_gbs.
"""

from __future__ import annotations

from engram.config import JobConfig
from planner.nvme import record_bytes, step_rows
from planner.results import GIB, RankMemory
from planner.tier_results import TableCheckpoint, TierAssumptions

ROW_ID_BYTES = 8


def touched_rows(per_step: int, interval: int, reuse_window: float, local_rows: int) -> int:
    """Distinct rows of one shard touched over `interval` steps (see the module docstring)."""
    return min(local_rows, round(per_step * (1 + (interval - 1) * (1 - reuse_window))))


def table_checkpoint(
    cfg: JobConfig, mem: RankMemory, ranks_per_node: int, host_bytes: int, a: TierAssumptions
) -> TableCheckpoint:
    """The table checkpoint terms of the rank `mem`, times `ranks_per_node`."""
    record = record_bytes(cfg.optimizer.table_optimizer, cfg.engram.head_dim)
    interval = max(1, cfg.checkpoint.interval)
    local = list(mem.table_rows.values())
    touched = [touched_rows(step_rows(cfg, a, r), interval, a.reuse_window, r) for r in local]
    return TableCheckpoint(
        interval_steps=interval,
        full_bytes=ranks_per_node * sum(local) * record,
        incremental_bytes=ranks_per_node * sum(touched) * (record + ROW_ID_BYTES),
        touched_rows_per_table=max(touched, default=0),
        write_gbs=a.checkpoint_write_gbs,
        host_bytes=host_bytes,
    )


def table_checkpoint_markdown(c: TableCheckpoint | None, location: str) -> list[str]:
    """The report's lines (none without Engram tables)."""
    if c is None:
        return []
    gib = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    lines = [
        "",
        f"### Engram table checkpoint per node, every {c.interval_steps} steps "
        "(planner/table_checkpoint.py)",
        "",
        f"- full (every row + optimizer state): {gib(c.full_bytes)} GiB, "
        f"{c.full_seconds:.1f} s at {c.write_gbs:g} GB/s per node",
        f"- incremental (rows touched since the last save, {c.touched_rows_per_table:,} per "
        f"table per rank, + row ids): {gib(c.incremental_bytes)} GiB, "
        f"{c.incremental_seconds:.1f} s ({c.incremental_bytes / max(1, c.full_bytes):.1%} of "
        "full); the runtime writes full saves today",
    ]
    if location == "nvme" and c.host_bytes and c.full_bytes > c.host_bytes:
        lines.append(
            f"- WARNING: a full save reads the NVMe shards into host memory whole today "
            f"({gib(c.full_bytes)} GiB per node > {gib(c.host_bytes)} GiB): it needs saves "
            "that stream or write only touched rows (docs/host_tables.md, not done yet)"
        )
    return lines
