"""The Engram tables on ranks: row-sharded over the "engram" mesh axis, never gathered or
replicated, looked up by an all-to-all; their shards live in device memory, in host memory or on
NVMe drives (engram.table_location), each behind a row store (engram/rowstore/).

What belongs here is how a table is placed and looked up, nothing of the model, the planner or
the storage under a shard (pages, files, I/O: engram/rowstore/):

- `routing.py`: what both lookups share: the torch.chunk row split, ids to their owners,
  rows back in order, row gradients to their owners (the all-to-all halves).
- `lookup.py`: the device lookup (`sharded_embedding_lookup`, `ShardedEngramTable`).
- `host.py`: host-resident shards (`HostShardedEngramTable`): lookups through the host row
  store, prefetched lookups queued per table (which ids a step's lookups see under each layout:
  parallelisms/table_prefetch.py).
- `nvme.py`: NVMe-resident shards (`NvmeShardedEngramTable`): the host table's lookup over the
  NVMe row store (engram/rowstore/nvme_store.py); `page_in_ahead`: a later step's rows, paged in
  while this one runs.
- `sharding.py`: `apply_engram_table_sharding`, the step of parallelize_model that turns every
  table into one of the three, and `LOCATION_BACKENDS`, each location's table class and row
  store.
- `host_memory.py`: the start-time refusal when a node's host memory cannot hold host tables.

Imports run one way: routing <- lookup <- host <- nvme <- sharding, host <- host_memory. The
names below are the package's public API.
"""

from parallelisms.engram_tables.host import HostShardedEngramTable, host_table_modules
from parallelisms.engram_tables.host_memory import (
    check_host_memory,
    host_table_bytes,
    mem_available_bytes,
)
from parallelisms.engram_tables.lookup import ShardedEngramTable, sharded_embedding_lookup
from parallelisms.engram_tables.nvme import NvmeSettings, NvmeShardedEngramTable
from parallelisms.engram_tables.routing import LookupSettings, local_row_range, row_chunk
from parallelisms.engram_tables.sharding import LOCATION_BACKENDS, apply_engram_table_sharding

__all__ = [
    "LOCATION_BACKENDS",
    "NvmeSettings",
    "NvmeShardedEngramTable",
    "HostShardedEngramTable",
    "LookupSettings",
    "ShardedEngramTable",
    "apply_engram_table_sharding",
    "check_host_memory",
    "host_table_bytes",
    "host_table_modules",
    "local_row_range",
    "mem_available_bytes",
    "row_chunk",
    "sharded_embedding_lookup",
]
