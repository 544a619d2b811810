"""The result types of the Engram table tiers' plan (planner/nvme.py,
planner/table_checkpoint.py) and the assumptions they are planned with; MemoryEstimate holds
them (planner/results.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierAssumptions:
    """Hardware and workload figures the NVMe and table-checkpoint terms use (CLI flags)."""

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
    unique_rows_per_step: int = 132_000
    """Distinct rows of one table a step touches per owner rank (measured max 132,035 at 64
    ranks on the 1T config's 7.8B-row tables, 131,743 on 1.56B-row ones, with a 77k-token
    byte-level BPE; 28k with the 2k debug tokenizer: docs/host_tables.md, "Row reuse on real
    text")."""
    reuse_last_step: float = 0.264
    """Share of a step's rows touched in the step before (measured 26.4% on the 1T config's
    tables, 26.5% on 1.56B-row ones)."""
    reuse_window: float = 0.444
    """Share of a step's rows touched in the last few steps (measured 44.4% over 4 steps):
    new rows per step over a save interval are (1 - this) of a step's rows."""
    reuse_source: str = (
        "a 77,166-token byte-level BPE of Qwen2.5's shape (benchmarks/local_bpe.py; the local "
        "corpus ran out of merges before 151,665) on Vim help + Node.js docs, 64 ranks"
    )
    """Where the three reuse figures above were measured (the tokenizer and the corpus): the
    plan prints it beside them."""
    checkpoint_write_gbs: float = 5.0
    """GB/s a node writes checkpoint files at (to the checkpoint folder's storage)."""


@dataclass
class NvmeTier:
    """Per node (ranks_per_node x the largest reported rank), per step where it says."""

    assumptions: TierAssumptions
    record_bytes: int
    page_bytes: int
    rows_per_page: int
    drive_bytes_needed: int
    drive_bytes: int
    cache_bytes_per_rank: int
    host_bytes_needed: int
    """Per node: host caches + staging + the stores' page index (INDEX_BYTES_PER_PAGE a page) +
    cpu_offload state + async checkpoint staging."""
    host_bytes: int
    """Host memory per node (engram.host_memory_gib / --host_memory_gib; 0: not checked)."""
    step_rows_per_table: int
    pages_read_per_step: int
    pages_written_per_step: int
    io_seconds_per_step: float
    drive_writes_per_day: float
    problems: list[str] = field(default_factory=list)
    """What does not fit, each naming the setting or flag to change."""


@dataclass
class TableCheckpoint:
    """Per node (ranks_per_node x the largest reported rank), one save."""

    interval_steps: int
    full_bytes: int
    incremental_bytes: int
    touched_rows_per_table: int
    """Rows of one table per rank touched over the interval."""
    write_gbs: float
    host_bytes: int
    """Host memory per node (0: not stated)."""
    save_host_bytes: int = 0
    """Table data a full save holds in host memory per node at its peak (NVMe tables: a
    synchronous save streams one chunk per rank; an asynchronous one reads every shard
    column whole (its staging copy is counted with the NVMe tier); 0: not modelled, the tables' own memory is counted elsewhere)."""
    streams: bool = False
    """Whether a full save streams the tables (NVMe tables, synchronous saves)."""

    @property
    def full_seconds(self) -> float:
        return self.full_bytes / (self.write_gbs * 1e9)

    @property
    def incremental_seconds(self) -> float:
        return self.incremental_bytes / (self.write_gbs * 1e9)
