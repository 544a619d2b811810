"""Where an Engram table shard's rows live: the row-store interface and its backends (device
memory, host memory, NVMe page files), and what carries rows between them and the step.

A row store holds the rows of one rank's table shard (and, on NVMe, their row-sparse optimizer
state). Lookups (parallelisms/engram_tables/), the row-sparse optimizers (engram/optim/),
checkpoints (engram/checkpoint/), the init (engram/models/init.py) and the Hugging Face load
(engram/hf/load.py) see a shard only through it. Nothing here knows how a table is sharded or
looked up: that is parallelisms/engram_tables/, which pairs each engram.table_location with its
backend (sharding.py `LOCATION_BACKENDS`).

- `interface.py`: the row-store interface (`RowStore`), and `ColumnRowStore`: a store that keeps
  the row-sparse optimizer state beside each row, the type its readers in engram/ hold.
- `memory.py`: the memory backends (`DeviceRowStore`, `HostRowStore`: host-side gathers into
  page-locked staging on the host worker).
- `nvme_store.py`: the NVMe backend (`NvmeRowStore`): rows and optimizer state as fp32 records
  in pages, over its page cache and page I/O:
  - `page_cache.py`: which page is in which host slot (LRU, dirty pages written back when
    evicted, pins, pages read ahead of their step, and why a step still sees exact rows);
  - `page_io.py`: the page files and the moves of pages between them and the slots (native
    AIO with O_DIRECT, else preadv / pwritev, on a small thread pool; pages never written read
    as zeros without I/O);
  - `page_sums.py`: a checksum per page written, checked on every page read.
- `page_files.py`: the NVMe store's page files: created locked and preallocated, files of dead
  runs swept, page I/O errors that name the fix.
- `nvme_checks.py`: the start-time refusals of the NVMe settings by name
  (`check_nvme_settings`: missing, duplicate, unwritable directories; the host cache's size).
- `linux_aio.py`: batched native Linux AIO (io_submit / io_getevents) for O_DIRECT pages.
- `tier_rules.py`: the NVMe tier's rules the planner and the run's start-up checks share (page
  file bytes, page I/O per step, drive writes per day, the capacity problem, the warnings).
- `drive_probe.py`: a second of random 4 KiB reads, the way the store reads its pages.
- `host_worker.py`: the one FIFO thread per process that runs every host-side table job (the
  exactness argument of host and NVMe tables), and the markers on a table parameter (where its
  shard lives; the row store that holds it).
- `streamed_columns.py`: a checkpoint's stand-ins for an NVMe table's columns, read and written
  a row chunk at a time.

A new storage tier: its `RowStore` backend here, its table class in parallelisms/engram_tables/
and its line in engram/config/table_locations.py. Everything here may import engram/runtime/
only; parallelisms/ uses the stores, never the page files or the AIO engine directly.
"""
