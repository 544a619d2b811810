"""The NVMe row store (engram.table_location = "nvme"): a table shard's rows and their row-sparse
optimizer state in files on local disk, with a bounded host cache in front.

Layout. One record per row: the row's columns side by side in fp32 (the weight, then the
optimizer's state: lazy_adam's exp_avg and exp_avg_sq, rowwise_adagrad's per-row sum), so one
read brings everything an update needs. Records are packed into pages of 4 KiB (or a multiple,
for records above 4 KiB): a page holds `rows_per_page` whole records, and no record crosses a
page. Page p lives in file p % len(dirs) at offset (p // len(dirs)) x page_bytes: the pages of a
shard stripe over the directories (one per drive).

I/O. Files are opened with O_DIRECT where the file system allows it (tmpfs, some network file
systems do not: then buffered, with the reason logged once); buffers are page-aligned slots of
one anonymous mapping; reads and write-backs of a batch of pages run on a thread pool (os.preadv
/ os.pwritev release the GIL).

Cache. `cache_bytes` of page slots, least recently used first out; a dirty page is written back
when it is evicted (and by `flush`). `pin(idx)` loads the pages of rows `idx` and holds them
until `release(idx)`: a step's rows stay in host memory from prefetch to their last use, so
reads and updates never wait on the disk mid-step. A pin that cannot fit the cache is refused,
naming the setting to raise. The store is not thread-safe: the tables use it from the one FIFO
host worker (engram/runtime/host_worker.py).

The files are scratch space: a checkpoint saves the columns as tensors through DCP like host
tables, read out chunk by chunk (`read_range`, engram/checkpoint/streamed_dcp.py), and a resume
writes them back (`load` at a row offset). They are created, locked, preallocated and, when a
killed run left them, swept by page_files.py; page I/O errors name the fix there.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engram.runtime import faults
from engram.runtime.host_worker import HOST_WORKER
from parallelisms.engram_tables.page_files import create_page_file, page_io_error
from parallelisms.engram_tables.row_store import RowStore

__all__ = ["PAGE_BYTES", "NvmeRowStore", "page_layout"]

log = logging.getLogger(__name__)

PAGE_BYTES = 4096  # the logical block size O_DIRECT aligns offsets, lengths and buffers to


def page_layout(record_bytes: int) -> tuple[int, int]:
    """(page_bytes, rows_per_page) for records of `record_bytes`: whole records per 4 KiB page,
    or one record per page of the next multiple of 4 KiB."""
    page = PAGE_BYTES * max(1, -(-record_bytes // PAGE_BYTES))
    return page, page // record_bytes


class NvmeRowStore(RowStore):
    """Rows [rows, columns...] of one shard in page files under `dirs`, cached in `cache_bytes`
    of host memory (see the module docstring). `columns`: name -> width in fp32 values (0: one
    value per row, read as shape [n]); the first is the weight."""

    location = "nvme"

    def __init__(
        self,
        rows: int,
        columns: dict[str, int],
        dirs: list[str],
        cache_bytes: int,
        name: str = "table",
        threads: int = 4,
        direct: bool = True,
    ) -> None:
        if not columns or not dirs:
            raise ValueError("an NVMe row store needs at least one column and one directory")
        self.rows, self.columns = rows, dict(columns)
        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for col, width in self.columns.items():
            self.offsets[col] = (off, max(1, width))
            off += max(1, width)
        self.record_floats = off
        self.page_bytes, self.rows_per_page = page_layout(4 * off)
        self.pages = -(-rows // self.rows_per_page)
        self.cache_pages = cache_bytes // self.page_bytes
        if self.cache_pages < 1:
            raise ValueError(
                f"NVMe host cache of {cache_bytes} B holds no {self.page_bytes} B page: raise "
                "engram.nvme_host_cache_gib"
            )
        self.fds, self.paths, reasons = [], [], set()
        try:
            for i, d in enumerate(dirs):
                per_file = -(-(self.pages - i) // len(dirs))  # pages i, i + len(dirs), ...
                fd, path, reason = create_page_file(d, name, per_file * self.page_bytes, direct)
                self.fds.append(fd)
                self.paths.append(path)
                if reason:
                    reasons.add(reason)
        except BaseException:
            self.remove_files()
            raise
        self.direct = not reasons
        for reason in sorted(reasons):
            log.warning("NVMe Engram table %s: buffered I/O: %s", name, reason)
        self._buf = mmap.mmap(-1, self.cache_pages * self.page_bytes)  # page-aligned slots
        self._slots = torch.frombuffer(self._buf, dtype=torch.float32).view(
            self.cache_pages, self.page_bytes // 4
        )
        self._free = list(range(self.cache_pages - 1, -1, -1))
        self._where: OrderedDict[int, int] = OrderedDict()  # page -> slot, LRU first
        self._slot_of = torch.full((self.pages,), -1, dtype=torch.long)  # the same, as a tensor
        self._dirty: set[int] = set()
        self._pins: dict[int, int] = {}  # page -> pin count
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="engram-nvme")
        self.reads = self.writes = 0  # pages moved, for tests and benchmarks
        self.pins_taken = 0
        self.read_out_bytes = self.read_out_peak = 0  # columns read out (checkpoints)

    # -- pages ---------------------------------------------------------------------------
    def _file_pos(self, page: int) -> tuple[int, int]:
        return self.fds[page % len(self.fds)], (page // len(self.fds)) * self.page_bytes

    def _view(self, slot: int) -> memoryview:
        return memoryview(self._buf)[slot * self.page_bytes : (slot + 1) * self.page_bytes]

    def _io(self, jobs: list[tuple[int, int]], write: bool) -> None:
        """Read (or write back) pages (page, slot) on the thread pool, one share of the pages
        per thread (a future per page costs more than its 4 KiB read); raise the first error."""

        def share(part: list[tuple[int, int]]) -> None:
            move = os.pwritev if write else os.preadv
            for page, slot in part:
                fd, pos = self._file_pos(page)
                try:
                    done = move(fd, [self._view(slot)], pos)
                    if write:
                        faults.point("nvme.page_write")
                except OSError as e:
                    raise page_io_error(e, self.paths[page % len(self.fds)], write) from e
                if done != self.page_bytes:
                    raise OSError(f"short {'write' if write else 'read'} of a page: {done} B")

        threads = self._pool._max_workers
        for _ in self._pool.map(share, [jobs[i::threads] for i in range(threads) if jobs[i:]]):
            pass
        if write:
            self.writes += len(jobs)
        else:
            self.reads += len(jobs)

    def _load(self, pages: list[int]) -> None:
        """Bring `pages` into the cache (LRU unpinned pages out, dirty ones written back)."""
        missing = [p for p in pages if p not in self._where]
        for p in pages:
            if p in self._where:
                self._where.move_to_end(p)
        if not missing:
            return
        need, needed, victims = len(missing) - len(self._free), set(pages), []
        for p in self._where if need > 0 else ():  # least recently used first
            if p not in self._pins and p not in needed:
                victims.append(p)
                if len(victims) == need:
                    break
        if len(victims) < need:
            raise RuntimeError(
                f"NVMe Engram table: {len(missing) + len(self._where)} pages pinned or needed "
                f"at once but the host cache holds {self.cache_pages} ({self.page_bytes} B "
                "each): raise engram.nvme_host_cache_gib (a step's rows must fit)"
            )
        evict = []
        for victim in victims:
            slot = self._where.pop(victim)
            self._slot_of[victim] = -1
            if victim in self._dirty:
                evict.append((victim, slot))
                self._dirty.discard(victim)
            self._free.append(slot)
        self._io(evict, write=True)
        jobs = [(p, self._free.pop()) for p in missing]
        self._io(jobs, write=False)
        for p, slot in jobs:
            self._where[p] = slot
            self._slot_of[p] = slot

    def _pages(self, idx: torch.Tensor) -> list[int]:
        return torch.unique(idx.to("cpu", torch.long) // self.rows_per_page).tolist()

    def _record_index(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache slot, record within the page) of each row of `idx` (its page is cached)."""
        idx = idx.to("cpu", torch.long)
        return self._slot_of[idx // self.rows_per_page], idx % self.rows_per_page

    def _records(self) -> torch.Tensor:
        """The cache as [slot, record, fp32 value] (a view: writes land in the slots)."""
        per = self.rows_per_page * self.record_floats
        return self._slots[:, :per].view(self.cache_pages, self.rows_per_page, -1)

    # -- the row-store interface ------------------------------------------------------------
    def read_columns(self, idx: torch.Tensor, names: list[str] | None = None) -> dict:
        """{column: its rows `idx`} (copies; a width-0 column as shape [n])."""
        self._load(self._pages(idx))
        rec = self._records()[self._record_index(idx)]
        out = {}
        for col in names or list(self.columns):
            lo, width = self.offsets[col]
            values = rec[:, lo : lo + width].clone()
            out[col] = values.squeeze(1) if self.columns[col] == 0 else values
        return out

    def write_columns(self, idx: torch.Tensor, values: dict) -> None:
        """Overwrite columns of rows `idx` (unique) with `values` {column: [n, width] or [n]}."""
        pages = self._pages(idx)
        self._load(pages)
        where = self._record_index(idx)
        records = self._records()
        rows = records[where]
        for col, v in values.items():
            lo, width = self.offsets[col]
            rows[:, lo : lo + width] = v.reshape(-1, width).to(torch.float32)
        records[where] = rows
        self._dirty.update(pages)

    def read_rows(self, idx: torch.Tensor) -> torch.Tensor:
        return self.read_columns(idx, [next(iter(self.columns))])[next(iter(self.columns))]

    def write_rows(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        self.write_columns(idx, {next(iter(self.columns)): rows})

    def prefetch(self, idx: torch.Tensor, device: torch.device, pin: bool = True) -> Future:
        """Queued on the host worker (behind every queued update): pin, then read."""
        return HOST_WORKER.submit(self._read_to, idx, device, pin)

    def _read_to(self, idx: torch.Tensor, device: torch.device, pin: bool):
        if pin:
            self.pin(idx)
        return self.read_rows(idx).to(device), None

    def pin(self, idx: torch.Tensor) -> None:
        pages = self._pages(idx)
        self._load(pages)
        self.pins_taken += 1
        for p in pages:
            self._pins[p] = self._pins.get(p, 0) + 1

    def release(self, idx: torch.Tensor) -> None:
        for p in self._pages(idx):
            n = self._pins.get(p, 0) - 1
            if n < 0:
                raise RuntimeError("NVMe Engram table: a release without its pin")
            if n:
                self._pins[p] = n
            else:
                self._pins.pop(p)

    def release_all(self) -> None:
        self._pins.clear()

    def flush(self) -> None:
        """Write every dirty cached page back (they stay cached)."""
        self._io([(p, self._where[p]) for p in sorted(self._dirty)], write=True)
        self._dirty.clear()

    def snapshot(self, name: str | None = None) -> torch.Tensor:
        """Column `name` (default the weight) of every row (the whole column in host memory:
        a checkpoint streams it with `read_range` instead, engram/runtime/streamed_columns.py)."""
        return self.read_range(name or next(iter(self.columns)), 0, self.rows)

    def read_range(self, name: str, r0: int, n: int) -> torch.Tensor:
        """Column `name` of rows [r0, r0 + n), read page by page without touching the cache's
        order: cached pages (newer than the disk when dirty) from the cache, the others from
        disk into a scratch page. Counts the bytes it returns (`read_out_bytes`, the largest
        one read in `read_out_peak`)."""
        lo, width = self.offsets[name]
        out = torch.empty(n, width, dtype=torch.float32)
        scratch = mmap.mmap(-1, self.page_bytes)
        per = self.rows_per_page * self.record_floats
        end = r0 + n
        for p in range(r0 // self.rows_per_page, -(-end // self.rows_per_page)):
            if p in self._where:
                page = self._slots[self._where[p], :per]
            else:
                fd, pos = self._file_pos(p)
                os.preadv(fd, [scratch], pos)
                page = torch.frombuffer(scratch, dtype=torch.float32)[:per]
            a, b = max(r0, p * self.rows_per_page), min(end, (p + 1) * self.rows_per_page)
            first = a - p * self.rows_per_page
            out[a - r0 : b - r0] = page.view(self.rows_per_page, -1)[
                first : first + b - a, lo : lo + width
            ]
        scratch.close()
        self.read_out_bytes += out.nbytes
        self.read_out_peak = max(self.read_out_peak, out.nbytes)
        return out.squeeze(1) if self.columns[name] == 0 else out

    def load(self, values: dict, chunk_rows: int | None = None, row0: int = 0) -> None:
        """Write columns {name: [n, width] or [n]} into rows [row0, row0 + n) (a fresh init,
        a resume; default all rows), through the cache in chunks of at most half of it."""
        chunk = chunk_rows or max(1, self.cache_pages // 2 * self.rows_per_page)
        n = len(next(iter(values.values()))) if values else 0
        for r0 in range(0, n, chunk):
            idx = torch.arange(row0 + r0, row0 + min(n, r0 + chunk))
            self.write_columns(idx, {k: v[r0 : r0 + idx.numel()] for k, v in values.items()})

    def close(self) -> None:
        self._pool.shutdown()
        for fd in self.fds:
            os.close(fd)  # drops the file's lock: a later sweep may remove it
        self.fds = []

    def remove_files(self) -> None:
        """Close and delete the page files (scratch)."""
        for fd in self.fds:
            os.close(fd)
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.fds, self.paths = [], []

    @property
    def cached_bytes(self) -> int:
        return len(self._where) * self.page_bytes
