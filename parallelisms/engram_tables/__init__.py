"""The Engram tables on ranks: row-sharded over the "engram" mesh axis, never gathered or
replicated, looked up by an all-to-all; their shards live in device or in host memory
(engram.table_location).

What belongs here is how a table is placed and looked up, nothing of the model or the planner:

- `routing.py`: what both lookups share: the torch.chunk row split, ids to their owners,
  rows back in order, row gradients to their owners (the all-to-all halves).
- `lookup.py`: the device lookup (`sharded_embedding_lookup`, `ShardedEngramTable`).
- `row_store.py`: the row-store interface under a shard (read / write rows, prefetch, pin /
  release, snapshot) and its backends per engram.table_location (device, host: host gathers on
  the host worker into page-locked staging).
- `host.py`: host-resident shards (`HostShardedEngramTable`): lookups through the host row
  store, prefetched lookups queued per table (which ids a step's lookups see under each layout:
  parallelisms/table_prefetch.py).
- `nvme_store.py`, `nvme.py`: the NVMe backend (page files with O_DIRECT, batched native AIO
  (`linux_aio.py`) on a small thread pool, and a
  host cache with pins, pages read ahead of their step) and the NVMe-resident table over it
  (`NvmeShardedEngramTable`; `page_in_ahead`: a later step's rows, paged in while this one runs).
- `page_files.py`: the NVMe store's page files: created locked and preallocated, files of dead
  runs swept, page I/O errors that name the fix.
- `sharding.py`: `apply_engram_table_sharding`, the step of parallelize_model that turns every
  table into one of the two.
- `host_memory.py`: the start-time refusal when a node's host memory cannot hold host tables.

Imports run one way: routing <- lookup <- host <- nvme <- sharding, row_store <- host <-
host_memory, row_store <- nvme_store <- nvme, page_files <- nvme_store. The names below are the
package's public API.
"""

from parallelisms.engram_tables.host import HostShardedEngramTable, host_table_modules
from parallelisms.engram_tables.host_memory import (
    check_host_memory,
    host_table_bytes,
    mem_available_bytes,
)
from parallelisms.engram_tables.lookup import ShardedEngramTable, sharded_embedding_lookup
from parallelisms.engram_tables.nvme import NvmeSettings, NvmeShardedEngramTable
from parallelisms.engram_tables.nvme_store import NvmeRowStore
from parallelisms.engram_tables.routing import LookupSettings, local_row_range, row_chunk
from parallelisms.engram_tables.row_store import (
    STAGING_CHUNK_BYTES,
    DeviceRowStore,
    HostRowStore,
    RowStore,
    pin_staging,
)
from parallelisms.engram_tables.sharding import LOCATION_BACKENDS, apply_engram_table_sharding

__all__ = [
    "LOCATION_BACKENDS",
    "NvmeRowStore",
    "NvmeSettings",
    "NvmeShardedEngramTable",
    "STAGING_CHUNK_BYTES",
    "DeviceRowStore",
    "HostRowStore",
    "RowStore",
    "HostShardedEngramTable",
    "LookupSettings",
    "ShardedEngramTable",
    "apply_engram_table_sharding",
    "check_host_memory",
    "host_table_bytes",
    "host_table_modules",
    "local_row_range",
    "mem_available_bytes",
    "pin_staging",
    "row_chunk",
    "sharded_embedding_lookup",
]
