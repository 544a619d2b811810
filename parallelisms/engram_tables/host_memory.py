"""Host memory of host-resident Engram tables: bytes per rank, and the start-time refusal when
a node's host memory cannot hold them (engram.host_memory_gib)."""

from __future__ import annotations

import os

from torch import nn

from engram.config.table_optimizers import table_memory_bytes
from engram.rowstore.memory import STAGING_CHUNK_BYTES
from parallelisms.engram_tables.host import host_table_modules
from parallelisms.engram_tables.nvme import NvmeShardedEngramTable

__all__ = ["check_host_memory", "host_table_bytes", "mem_available_bytes"]


def host_table_bytes(model: nn.Module, table_optimizer: str) -> int:
    """Host bytes of this rank's host tables: shard + optimizer state (the table optimizer's
    spec, engram/config/table_optimizers.py) + one staging buffer per table
    (<= STAGING_CHUNK_BYTES); an NVMe table's host cache + staging (its shard is on disk, but
    the init writes it once through host memory: not counted)."""
    total = 0
    for table in host_table_modules(model):
        if isinstance(table, NvmeShardedEngramTable):  # its rows are on disk: only its cache
            total += table._engram_nvme.cache_bytes_per_table + STAGING_CHUNK_BYTES
            continue
        local = table.weight.to_local()  # meta before to_empty: shapes only
        parts = table_memory_bytes(
            table_optimizer, local.shape[0], local.shape[1], local.element_size()
        )
        total += parts["weight"] + parts["optimizer"] + STAGING_CHUNK_BYTES
    return total


def mem_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_memory(
    model_parts: list[nn.Module], table_optimizer: str, ranks_per_node: int, limit_gib: float
) -> None:
    """Refuse a run whose host tables cannot fit the node's memory (before allocating them):
    this rank's host bytes x `ranks_per_node` against `limit_gib` GiB (0: MemAvailable)."""
    per_rank = sum(host_table_bytes(part, table_optimizer) for part in model_parts)
    if per_rank == 0:
        return
    need = per_rank * ranks_per_node
    have = int(limit_gib * 2**30) if limit_gib > 0 else mem_available_bytes()
    if need > have:
        source = f"engram.host_memory_gib = {limit_gib}" if limit_gib > 0 else "MemAvailable"
        raise ValueError(
            f"host Engram tables need {need / 2**30:.2f} GiB of host memory per node "
            f"({per_rank / 2**30:.2f} GiB per rank x {ranks_per_node} ranks: shard + "
            f"{table_optimizer} state + staging) but {have / 2**30:.2f} GiB are available "
            f"({source}): use more nodes (more ranks share the rows), rowwise_adagrad (4 B of "
            "state per row instead of 8 B per parameter), smaller tables, or "
            'engram.table_location = "device"'
        )
