"""The NVMe tier's rules, stated once for the memory planner (planner/nvme.py, per node, from
assumed hardware) and for the run's start-up checks (runner/start_checks.py, per drive, from
what it finds): page-file bytes, the page I/O a step needs, what that costs a drive per step
and per day, and the problems and warnings they lead to, each naming both numbers and the fix.

Counted as nvme_store.py lays a shard out: one fp32 record per row (the weight, then the
row-sparse optimizer's state columns), whole records in 4 KiB pages (`page_layout`), so a shard
of `rows` rows has ceil(rows / rows_per_page) pages.

Traffic per step comes from the measured row reuse (docs/host_tables.md, "Row reuse on real
text"), the workload figures of `TierAssumptions`: `unique_rows_per_step` rows of each table per
owner rank (at most its lookup ids), of which `reuse_last_step` were in the last step and still
cached (when the cache holds two steps' pages), so the rest is read; the rows are scattered, so
each read row costs one page I/O, and in steady state every page read is later written back
dirty (the update touched it). Hardware figures are assumptions the planner prints (CLI flags);
the run replaces them by what it measures where it can (free space, a drive probe).
"""

from __future__ import annotations

from dataclasses import dataclass

from engram.rowstore.nvme_store import PAGE_BYTES, page_layout
from engram.runtime.filesystems import size_text

__all__ = [
    "SECONDS_PER_DAY",
    "TierAssumptions",
    "drive_writes_per_day",
    "endurance_warning",
    "io_seconds",
    "lookup_ids_per_owner",
    "page_file_bytes",
    "page_space_problem",
    "pages_read_per_step",
    "probe_warning",
    "record_bytes",
    "step_rows",
]

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class TierAssumptions:
    """Hardware and workload figures the NVMe and table-checkpoint terms use (planner CLI flags;
    the run's start-up checks use the defaults where it cannot measure)."""

    nvme_drives_per_node: int = 8
    nvme_tb_per_drive: float = 7.68
    """Usable TB (10^12 B) per drive for the page files."""
    nvme_read_kiops: float = 875.0
    """Random 4 KiB reads per second per drive, thousands (data-centre Gen4 spec sheets)."""
    nvme_write_kiops: float = 200.0
    nvme_read_gbs: float = 6.8
    """Sequential-size read GB/s per drive (caps large pages)."""
    nvme_write_gbs: float = 4.0
    step_time_s: float = 30.0
    """The step time the I/O must fit in (the prefetch overlaps it with compute)."""
    unique_rows_per_step: int = 130_000
    """Distinct rows of one table a step touches per owner rank (measured max 129,885 at 64
    ranks on the 1T config's 7.8B-row tables, 129,780 on 1.56B-row ones, with a 151,665-token
    byte-level BPE; 28k with the 2k debug tokenizer: docs/host_tables.md, "Row reuse on real
    text")."""
    reuse_last_step: float = 0.263
    """Share of a step's rows touched in the step before (measured 26.3% on the 1T config's
    tables, 26.4% on 1.56B-row ones)."""
    reuse_window: float = 0.438
    """Share of a step's rows touched in the last few steps (measured 43.8% over 4 steps):
    new rows per step over a save interval are (1 - this) of a step's rows."""
    reuse_source: str = (
        "a 151,665-token byte-level BPE of Qwen2.5's shape (benchmarks/local_bpe.py, trained on "
        "205 MiB of local Vim help, Node.js docs and Python sources) on Vim help + Node.js docs, "
        "64 ranks"
    )
    """Where the three reuse figures above were measured (the tokenizer and the corpus): the
    plan prints it beside them."""
    checkpoint_write_gbs: float = 5.0
    """GB/s a node writes checkpoint files at (to the checkpoint folder's storage)."""
    rated_dwpd: float = 1.0
    """Drive writes per day the drives are rated for (read-intensive data-centre NVMe: 1; mixed
    use: 3): more is warned about."""


def record_bytes(dim: int, states_per_param: int, states_per_row: int) -> int:
    """Bytes of one row's record: fp32 weight + the optimizer's state columns (`dim` values per
    per-parameter state, one per per-row state), as NvmeRowStore packs it."""
    return 4 * (dim + states_per_param * dim + states_per_row)


def page_file_bytes(rows: int, record: int) -> int:
    """Bytes of the page files of a `rows`-row shard with `record`-byte records."""
    page, per_page = page_layout(record)
    return -(-rows // per_page) * page


def lookup_ids_per_owner(
    local_batch: int, seq_len: int, accum: int, heads: int, tp: int, cp: int
) -> int:
    """A step's lookup ids per owner rank: global tokens x hash heads spread over the stage's
    ranks, = per-rank tokens x heads / (tp x cp) (a tp x cp group shares its sequences)."""
    return local_batch * seq_len * accum * heads // (max(1, tp) * max(1, cp))


def step_rows(unique_rows_per_step: int, lookup_ids_per_owner: int, local_rows: int) -> int:
    """Distinct rows of one table a step touches on its owner rank: the measured figure, at most
    the step's lookup ids per owner and the shard's rows."""
    return min(unique_rows_per_step, lookup_ids_per_owner, local_rows)


def pages_read_per_step(a: TierAssumptions, rows: int, page: int, cache: int, n: int) -> int:
    """Pages one rank reads per step over its `n` tables of `rows` step rows each: the rows not
    cached from the last step (reuse counts only when each table's share of the `cache` bytes
    holds two steps' pages)."""
    keeps_last_step = cache // max(1, n) >= 2 * rows * page
    return n * round(rows * (1 - (a.reuse_last_step if keeps_last_step else 0.0)))


def io_seconds(pages: int, page_bytes: int, drives: int, kiops: float, gbs: float) -> float:
    """The slower of the IOPS and the bandwidth limit for `pages` random page I/Os over
    `drives` drives of `kiops` thousand 4 KiB I/Os and `gbs` GB/s each."""
    ios = pages * -(-page_bytes // PAGE_BYTES)  # a page above 4 KiB counts as its 4 KiB pieces
    return max(ios / (drives * kiops * 1e3), pages * page_bytes / (drives * gbs * 1e9))


def drive_writes_per_day(bytes_per_step: float, step_time_s: float, drive_bytes: int) -> float:
    """Drive writes per day of `bytes_per_step` written every `step_time_s` seconds onto
    `drive_bytes` of drives (before write amplification)."""
    return bytes_per_step * SECONDS_PER_DAY / step_time_s / max(1, drive_bytes)


def page_space_problem(need: int, have: int, scope: str, holder: str) -> str | None:
    """Page files of `need` bytes against `have` bytes of room: the problem, or None. `scope`
    says whose files (e.g. "per node"), `holder` what holds `have` (the drives, a directory's
    free space)."""
    if need <= have:
        return None
    return (
        f"NVMe capacity: the page files need {size_text(need)} {scope}, {holder} "
        f"{size_text(have)}: add drives or nodes, free space, point engram.nvme_dirs at "
        "bigger drives, or shrink the tables"
    )


def endurance_warning(dwpd: float, rated: float, what: str) -> str | None:
    """`dwpd` drive writes per day of `what` above the drives' `rated` endurance: the warning."""
    if dwpd <= rated:
        return None
    return (
        f"drive endurance: {what} write {dwpd:.2f} drive writes per day, above the {rated:g} "
        "the drives are rated for (TierAssumptions.rated_dwpd): they wear out early; save less "
        "often (checkpoint.interval), use incremental table checkpoints "
        "(checkpoint.table_full_every), a bigger host cache, or more drives"
    )


def probe_warning(
    reads_per_s: float, pages_per_step: int, page_bytes: int, step_time_s: float, where: str
) -> str | None:
    """A drive probe's random 4 KiB reads per second against the page reads a step needs: the
    warning when reading them would take longer than the step, naming both numbers."""
    need_s = pages_per_step * -(-page_bytes // PAGE_BYTES) / max(reads_per_s, 1e-9)
    if need_s <= step_time_s:
        return None
    return (
        f"drive probe: {where} reads {reads_per_s:,.0f} random 4 KiB pages per second; the plan "
        f"expects {pages_per_step:,} page reads per step per rank (planner/nvme.py), "
        f"{need_s:.2f} s at that rate, more than the {step_time_s:g} s step it assumes: "
        "steps will wait on the drive. Use local NVMe drives, more of them (engram.nvme_dirs), "
        "or a bigger host cache (engram.nvme_host_cache_gib)"
    )
