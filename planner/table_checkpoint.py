"""Engram table checkpoint bytes and time per save: full (every row and its optimizer state) vs
incremental (the rows touched since the previous save, with their row ids).

Full: a rank's shards as DCP saves them, fp32 weight + state columns per row (`record_bytes`).
Incremental: the rows a save interval touches per table and rank, from the measured reuse, with
their row ids (engram/checkpoint/capacity.py `touched_rows`, the rule the run's start-up checks
use too). Time: bytes per node / --checkpoint_write_gbs. The cadence table
(`cadence_rows`): for checkpoint.table_full_every = f, the bytes a save writes on average, the
checkpoint folder at its fullest under checkpoint.keep_latest_k (capacity.py
`kept_checkpoint_bytes`) and the drive writes per day at the save interval.

Host memory of a full save of NVMe tables (engram/checkpoint/streamed_dcp.py): a synchronous
save reads one chunk of one column at a time per rank (CHUNK_BYTES, engram/rowstore/
streamed_columns.py), so ranks_per_node x CHUNK_BYTES per node; checkpoint.async_mode =
"async" reads every column out whole (the full table bytes per node) and DCP's staging copies
it again (counted with the NVMe tier's host memory: planner/measure.py async_staging_bytes),
refused when both exceed the host's memory.
"""

from __future__ import annotations

from engram.checkpoint.capacity import (
    ROW_ID_BYTES,
    async_save_host_problem,
    kept_checkpoint_bytes,
    touched_rows,
)
from engram.config import JobConfig
from engram.rowstore.streamed_columns import CHUNK_BYTES
from engram.rowstore.tier_rules import drive_writes_per_day, endurance_warning
from planner.nvme import record_bytes, step_rows
from planner.results import GIB, RankMemory
from planner.tier_results import TableCheckpoint, TierAssumptions

__all__ = ["cadence_rows", "table_checkpoint", "table_checkpoint_markdown", "touched_rows"]

CADENCES = (1, 2, 5, 10, 20)  # checkpoint.table_full_every values the report compares


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
        keep_latest_k=cfg.checkpoint.keep_latest_k,
        table_full_every=cfg.checkpoint.table_full_every,
        saves=-(-cfg.training.steps // interval),
        step_time_s=a.step_time_s,
        drive_bytes=int(a.nvme_drives_per_node * a.nvme_tb_per_drive * 1e12),
        rated_dwpd=a.rated_dwpd,
    )


def table_checkpoint_problems(c: TableCheckpoint, tier_host_bytes: int) -> list[str]:
    """What a full save of NVMe tables cannot do, by name: an asynchronous save's whole
    columns with the NVMe tier's host memory (`tier_host_bytes`, its staging copy included)
    above the host's."""
    if c.streams:
        return []
    problem = async_save_host_problem(
        c.save_host_bytes, tier_host_bytes, c.host_bytes,
        "engram.host_memory_gib / --host_memory_gib",
    )  # fmt: skip
    return [problem] if problem else []


def cadence_rows(c: TableCheckpoint) -> list[tuple[int, float, float, float]]:
    """(table_full_every, GiB a save writes on average, GiB the folder holds at its fullest
    under keep_latest_k, drive writes per day of the saves) per node for each of CADENCES and
    the config's own cadence."""
    rows = []
    for f in sorted({*CADENCES, c.table_full_every}):
        per_save = (c.full_bytes + (f - 1) * c.incremental_bytes) / f
        kept = kept_checkpoint_bytes(
            c.full_bytes, c.incremental_bytes, c.keep_latest_k, f, max(c.saves, 1)
        )
        dwpd = drive_writes_per_day(per_save / c.interval_steps, c.step_time_s, c.drive_bytes)
        rows.append((f, per_save / GIB, kept / GIB, dwpd))
    return rows


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
        "",
        f"| table_full_every | GiB per save (mean) | GiB kept at keep_latest_k = "
        f"{c.keep_latest_k} | drive writes / day (if on the NVMe drives) |",
        "|---|---|---|---|",
        *[
            f"| {f}{' (config)' if f == c.table_full_every else ''} | {save:.1f} | "
            f"{kept:.1f} | {dwpd:.3f} |"
            for f, save, kept, dwpd in cadence_rows(c)
        ],
        "",
        "(a resume replays a base and at most table_full_every - 1 deltas: "
        "engram/checkpoint/table_delta.py)",
    ]
    config_row = next(r for r in cadence_rows(c) if r[0] == c.table_full_every)
    warning = endurance_warning(config_row[3], c.rated_dwpd, "the table saves")
    if warning:
        lines.append(f"- **{warning}**")
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
