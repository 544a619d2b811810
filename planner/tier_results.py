"""The result types of the Engram table tiers' plan (planner/nvme.py,
planner/table_checkpoint.py) and the assumptions they are planned with; MemoryEstimate holds
them (planner/results.py). TierAssumptions is engram/rowstore/tier_rules.py's: the run's
start-up checks plan with it too."""

from __future__ import annotations

from dataclasses import dataclass, field

from engram.rowstore.tier_rules import TierAssumptions

__all__ = ["NvmeTier", "TableCheckpoint", "TierAssumptions"]


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
    keep_latest_k: int = 3
    table_full_every: int = 1
    saves: int = 1
    """Saves over the run (training.steps / checkpoint.interval)."""
    step_time_s: float = 30.0
    drive_bytes: int = 0
    """The NVMe drives per node (the endurance column assumes the checkpoints go there)."""
    rated_dwpd: float = 1.0

    @property
    def full_seconds(self) -> float:
        return self.full_bytes / (self.write_gbs * 1e9)

    @property
    def incremental_seconds(self) -> float:
        return self.incremental_bytes / (self.write_gbs * 1e9)
