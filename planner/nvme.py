"""NVMe-resident Engram tables (engram.table_location = "nvme") in the plan: drive capacity per
node, the host cache and everything else the host holds per node, the page reads and writes a
step needs against the drives' IOPS and bandwidth, and drive endurance.

The rules (page-file bytes, page reads per step, I/O time, drive writes per day, and the
capacity problem) are engram/rowstore/tier_rules.py's, which the run's start-up checks
(runner/start_checks.py) call too: this file feeds them a config and the planned rank. Hardware
figures are assumptions (planner CLI flags), printed with the plan.
"""

from __future__ import annotations

import argparse
import dataclasses

from engram.config import JobConfig
from engram.config.table_optimizers import table_optimizer_spec
from engram.rowstore import tier_rules
from engram.rowstore.memory import STAGING_CHUNK_BYTES
from engram.rowstore.nvme_store import INDEX_BYTES_PER_PAGE, page_layout
from engram.rowstore.tier_rules import page_file_bytes
from planner.results import GIB, RankMemory
from planner.tier_results import NvmeTier, TierAssumptions

__all__ = ["nvme_tier", "page_file_bytes", "record_bytes", "step_rows", "tier_assumptions"]


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    """One flag per TierAssumptions field, default and help from the field."""
    docs = {
        "nvme_drives_per_node": "NVMe drives per node holding the page files",
        "nvme_tb_per_drive": "usable TB (10^12 B) per NVMe drive",
        "nvme_read_kiops": "random 4 KiB reads per second per drive, thousands",
        "nvme_write_kiops": "random 4 KiB writes per second per drive, thousands",
        "nvme_read_gbs": "read GB/s per drive",
        "nvme_write_gbs": "write GB/s per drive",
        "step_time_s": "step time (s) the NVMe table I/O must fit in",
        "unique_rows_per_step": "distinct rows of one table per owner rank per step (measured, "
        "docs/host_tables.md)",
        "reuse_last_step": "share of a step's rows touched the step before (measured)",
        "reuse_window": "share of a step's rows touched in the last few steps (measured)",
        "reuse_source": "where the reuse figures were measured: tokenizer and corpus (printed)",
        "checkpoint_write_gbs": "GB/s a node writes checkpoints at",
        "rated_dwpd": "drive writes per day the NVMe drives are rated for",
    }
    for f in dataclasses.fields(TierAssumptions):
        p.add_argument(
            f"--{f.name}",
            type=type(f.default),
            default=f.default,
            help=f"{docs[f.name]} (default {f.default}; an assumption, printed)",
        )


def tier_assumptions(opts: argparse.Namespace) -> TierAssumptions:
    return TierAssumptions(
        **{f.name: getattr(opts, f.name) for f in dataclasses.fields(TierAssumptions)}
    )


def record_bytes(table_optimizer: str, dim: int) -> int:
    """Bytes of one row's record under `table_optimizer` (tier_rules.record_bytes)."""
    spec = table_optimizer_spec(table_optimizer)
    return tier_rules.record_bytes(dim, spec.fp32_states_per_param, spec.fp32_states_per_row)


def step_rows(cfg: JobConfig, a: TierAssumptions, local_rows: int) -> int:
    """Distinct rows of one table a step touches on its owner rank (tier_rules.step_rows over
    tier_rules.lookup_ids_per_owner)."""
    t, par = cfg.training, cfg.parallelism
    ids = tier_rules.lookup_ids_per_owner(
        t.local_batch_size, t.seq_len, t.grad_accum_steps, cfg.engram.num_heads, par.tp, par.cp
    )
    return tier_rules.step_rows(a.unique_rows_per_step, ids, local_rows)


def nvme_tier(
    cfg: JobConfig, mem: RankMemory, ranks_per_node: int, host_bytes: int, a: TierAssumptions
) -> NvmeTier:
    """The NVMe terms of the rank `mem` (its tables' local rows), times `ranks_per_node`."""
    dim = cfg.engram.head_dim
    record = record_bytes(cfg.optimizer.table_optimizer, dim)
    page, per_page = page_layout(record)
    local = list(mem.table_rows.values())
    n = len(local)
    cache = int(cfg.engram.nvme_host_cache_gib * GIB)
    rows = max((step_rows(cfg, a, r) for r in local), default=0)
    read = tier_rules.pages_read_per_step(a, rows, page, cache, n) * ranks_per_node
    drives = a.nvme_drives_per_node
    io_s = tier_rules.io_seconds(read, page, drives, a.nvme_read_kiops, a.nvme_read_gbs)
    io_s += tier_rules.io_seconds(read, page, drives, a.nvme_write_kiops, a.nvme_write_gbs)
    drive = int(a.nvme_drives_per_node * a.nvme_tb_per_drive * 1e12)
    pages = sum(-(-r // per_page) for r in local)
    host_rank = (
        cache + STAGING_CHUNK_BYTES * n + INDEX_BYTES_PER_PAGE * pages + mem.host_bytes
        + mem.async_staging_bytes
    )  # fmt: skip
    tier = NvmeTier(
        assumptions=a,
        record_bytes=record,
        page_bytes=page,
        rows_per_page=per_page,
        drive_bytes_needed=ranks_per_node * sum(page_file_bytes(r, record) for r in local),
        drive_bytes=drive,
        cache_bytes_per_rank=cache,
        host_bytes_needed=ranks_per_node * host_rank,
        host_bytes=host_bytes,
        step_rows_per_table=rows,
        pages_read_per_step=read,
        pages_written_per_step=read,  # steady state: each page read is written back dirty
        io_seconds_per_step=io_s,
        drive_writes_per_day=tier_rules.drive_writes_per_day(read * page, a.step_time_s, drive),
    )
    tier.problems = _nvme_problems(tier, n)
    return tier


def _nvme_problems(t: NvmeTier, n_tables: int) -> list[str]:
    """What does not fit, by name."""
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    out = []
    space = tier_rules.page_space_problem(
        t.drive_bytes_needed, t.drive_bytes, "per node",
        "the drives (--nvme_drives_per_node x --nvme_tb_per_drive) hold",
    )  # fmt: skip
    out += [space] if space else []
    if t.host_bytes and t.host_bytes_needed > t.host_bytes:
        out.append(
            f"host memory: NVMe host caches + staging + page index need {gib(t.host_bytes_needed)} per node, "
            f"{gib(t.host_bytes)} available (engram.host_memory_gib / --host_memory_gib): lower "
            "engram.nvme_host_cache_gib"
        )
    need = n_tables * t.step_rows_per_table * t.page_bytes
    if t.cache_bytes_per_rank < need:
        out.append(
            f"NVMe host cache: a step pins {gib(need)} of pages per rank, the cache is "
            f"{gib(t.cache_bytes_per_rank)}: raise engram.nvme_host_cache_gib"
        )
    if t.io_seconds_per_step > t.assumptions.step_time_s:
        out.append(
            f"NVMe I/O: {t.io_seconds_per_step:.3g} s of page reads and writes per step > the "
            f"{t.assumptions.step_time_s} s step (--step_time_s): add drives (--nvme_drives_per_node) "
            "or raise engram.nvme_host_cache_gib"
        )
    return out


def nvme_markdown(t: NvmeTier | None) -> list[str]:
    """The NVMe tier's lines for the report (none without NVMe tables)."""
    if t is None:
        return []
    a = t.assumptions
    gib = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    wear = tier_rules.endurance_warning(t.drive_writes_per_day, a.rated_dwpd, "page write-backs")
    return [
        "",
        "### NVMe tables per node (planner/nvme.py; hardware figures are assumptions)",
        "",
        f"- records {t.record_bytes} B, {t.rows_per_page} per {t.page_bytes} B page; page files "
        f"{gib(t.drive_bytes_needed)} GiB of {gib(t.drive_bytes)} GiB "
        f"({a.nvme_drives_per_node} x {a.nvme_tb_per_drive} TB)",
        f"- host: caches + staging + page index + offload {gib(t.host_bytes_needed)} GiB of "
        + (f"{gib(t.host_bytes)} GiB" if t.host_bytes else "(host memory not stated)")
        + f"; cache {gib(t.cache_bytes_per_rank)} GiB per rank",
        f"- per step: {t.step_rows_per_table:,} rows per table per rank (measured reuse "
        f"{a.reuse_last_step:.0%} from the last step; reuse from {a.reuse_source}); "
        f"{t.pages_read_per_step:,} pages read and "
        f"as many written back per node: {t.io_seconds_per_step:.2f} s of I/O per "
        f"{a.step_time_s} s step ({a.nvme_read_kiops:g}k / {a.nvme_write_kiops:g}k IOPS, "
        f"{a.nvme_read_gbs:g} / {a.nvme_write_gbs:g} GB/s per drive)",
        f"- endurance: {t.drive_writes_per_day:.3f} drive writes per day (before write "
        "amplification)" + (f": **{wear}**" if wear else ""),
        f"- NVMe tier: **{'fits' if not t.problems else 'does NOT fit'}**"
        + "".join(f"\n  - {p}" for p in t.problems),
    ]
