"""Engram table checkpoint bytes and time per save: full (every row and its optimizer state) vs
incremental (the rows touched since the previous save, with their row ids).

Full: a rank's shards as DCP saves them, fp32 weight + state columns per row (`record_bytes`).
Incremental: the rows a save interval of I steps touches per table and rank, from the measured
reuse (docs/host_tables.md): a step touches u rows, of which `reuse_window` were touched in the
last few steps, so I steps touch u x (1 + (I - 1) x (1 - reuse_window)) rows, at most the shard;
each saved row carries an int64 id. Time: bytes per node / --checkpoint_write_gbs.

Host memory of a full save of NVMe tables (engram/checkpoint/streamed_dcp.py): a synchronous
save reads one chunk of one column at a time per rank (CHUNK_BYTES, engram/rowstore/
streamed_columns.py), so ranks_per_node x CHUNK_BYTES per node; checkpoint.async_mode =
"async" reads every column out whole (the full table bytes per node) and DCP's staging copies
it again (counted with the NVMe tier's host memory: planner/measure.py async_staging_bytes),
refused when both exceed the host's memory.
"""

from __future__ import annotations

from engram.config import JobConfig
from engram.rowstore.streamed_columns import CHUNK_BYTES
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
    full = ranks_per_node * sum(local) * record
    nvme = cfg.engram.table_location == "nvme"
    streams = nvme and cfg.checkpoint.async_mode != "async"
    largest_chunk = min(CHUNK_BYTES, max(local, default=0) * record) if local else 0
    return TableCheckpoint(
        interval_steps=interval,
        full_bytes=full,
        incremental_bytes=ranks_per_node * sum(touched) * (record + ROW_ID_BYTES),
        touched_rows_per_table=max(touched, default=0),
        write_gbs=a.checkpoint_write_gbs,
        host_bytes=host_bytes,
        save_host_bytes=(ranks_per_node * largest_chunk if streams else full) if nvme else 0,
        streams=streams,
    )


def table_checkpoint_problems(c: TableCheckpoint, tier_host_bytes: int) -> list[str]:
    """What a full save of NVMe tables cannot do, by name: an asynchronous save's whole
    columns with the NVMe tier's host memory (`tier_host_bytes`, its staging copy included)
    above the host's."""
    if c.streams or not c.save_host_bytes or not c.host_bytes:
        return []
    if c.save_host_bytes + tier_host_bytes <= c.host_bytes:
        return []
    return [
        f'checkpoint host memory: checkpoint.async_mode = "async" reads the NVMe tables\' '
        f"shards whole ({c.save_host_bytes / GIB:.1f} GiB per node) next to the NVMe tier's "
        f"{tier_host_bytes / GIB:.1f} GiB (caches, async staging copy), more than the "
        f"{c.host_bytes / GIB:.1f} GiB of host memory: set checkpoint.async_mode = "
        '"disabled" (a synchronous save streams the tables chunk by chunk)'
    ]


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
        "full; checkpoint.table_full_every > 1 writes them between full saves)",
    ]
    if location == "nvme" and c.streams:
        lines.append(
            f"- a full save streams the NVMe shards: {c.save_host_bytes / 2**20:.0f} MiB of "
            "table data in host memory per node at once (one chunk per rank)"
        )
    elif location == "nvme":
        lines.append(
            f'- checkpoint.async_mode = "async": a full save reads the NVMe shards into host '
            f"memory whole ({gib(c.save_host_bytes)} GiB per node) and stages a copy"
        )
    return lines
