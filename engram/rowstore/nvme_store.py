"""The NVMe row store (engram.table_location = "nvme"): a table shard's rows and their row-sparse
optimizer state in files on local disk, with a bounded host cache in front.

Layout. One record per row: the row's columns side by side in fp32 (the weight, then the
optimizer's state: lazy_adam's exp_avg and exp_avg_sq, rowwise_adagrad's per-row sum), so one
read brings everything an update needs. Records are packed into pages of 4 KiB (or a multiple,
for records above 4 KiB): a page holds `rows_per_page` whole records, and no record crosses a
page.

The store is three parts: `NvmeRowStore` (here) turns rows and columns into records in pages;
the page cache (page_cache.py: slots, LRU, dirty pages, pins, pages read ahead of their step,
and why a step's rows stay exactly those of the device tier) decides which pages are in host
memory; the page I/O (page_io.py: page files, O_DIRECT, native AIO or preadv / pwritev on a
small thread pool) moves them. The store is not thread-safe: the tables use it from the one
FIFO host worker (engram/rowstore/host_worker.py).

The files are scratch space: a checkpoint saves the columns as tensors through DCP like host
tables, read out chunk by chunk (`read_range`, engram/checkpoint/streamed_dcp.py), and a resume
writes them back (`load` at a row offset). They are created, locked, preallocated and, when a
killed run left them, swept by page_files.py; page I/O errors name the fix there.
"""

from __future__ import annotations

import mmap
from concurrent.futures import Future

import torch

from engram.rowstore.host_worker import HOST_WORKER
from engram.rowstore.interface import ColumnRowStore
from engram.rowstore.page_cache import PageCache
from engram.rowstore.page_io import PageIO

__all__ = ["PAGE_BYTES", "NvmeRowStore", "page_layout"]

PAGE_BYTES = 4096  # the logical block size O_DIRECT aligns offsets, lengths and buffers to


def page_layout(record_bytes: int) -> tuple[int, int]:
    """(page_bytes, rows_per_page) for records of `record_bytes`: whole records per 4 KiB page,
    or one record per page of the next multiple of 4 KiB."""
    page = PAGE_BYTES * max(1, -(-record_bytes // PAGE_BYTES))
    return page, page // record_bytes


class NvmeRowStore(ColumnRowStore):
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
        self.io = PageIO(self.pages, self.page_bytes, self.cache_pages, dirs, name, threads, direct)
        self.cache = PageCache(self.io, self.pages, self.cache_pages)
        self.pins_taken = 0
        self.read_out_bytes = self.read_out_peak = 0  # columns read out (checkpoints)

    # -- what tests and benchmarks count ------------------------------------------------------
    @property
    def direct(self) -> bool:
        """Whether the page files are O_DIRECT (else buffered, with the reason logged)."""
        return self.io.direct

    @property
    def paths(self) -> list[str]:
        return self.io.paths

    @property
    def reads(self) -> int:
        """Pages read from the files."""
        return self.io.reads

    @property
    def writes(self) -> int:
        """Pages written to the files."""
        return self.io.writes

    @property
    def paged_in(self) -> int:
        """Pages read ahead by page_in."""
        return self.cache.paged_in

    @property
    def page_in_waits(self) -> int:
        """Page-ins still in flight when a load needed the page."""
        return self.cache.page_in_waits

    @property
    def cached_bytes(self) -> int:
        return len(self.cache.where) * self.page_bytes

    def io_counters(self) -> dict[str, float]:
        """Cumulative page I/O since the store was made (engram/train/telemetry.py logs their
        growth per log window): pages read on demand and ahead, pages written back, pages the
        step's lookups pinned and of them those already resident (cached or read ahead),
        seconds loads waited for page-ins still in flight, bytes moved."""
        c = self.cache
        return {
            "pages_read_demand": self.io.reads - c.paged_in,
            "pages_read_ahead": c.paged_in,
            "pages_written": self.io.writes,
            "lookup_pages": c.lookup_pages,
            "lookup_hits": c.lookup_hits,
            "page_in_wait_s": c.page_in_wait_s,
            "bytes_moved": (self.io.reads + self.io.writes) * self.page_bytes,
        }

    # -- records --------------------------------------------------------------------------
    def _pages(self, idx: torch.Tensor) -> list[int]:
        return torch.unique(idx.to("cpu", torch.long) // self.rows_per_page).tolist()

    def _record_index(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache slot, record within the page) of each row of `idx` (its page is cached)."""
        idx = idx.to("cpu", torch.long)
        return self.cache.slot_of[idx // self.rows_per_page], idx % self.rows_per_page

    def _records(self) -> torch.Tensor:
        """The cache as [slot, record, fp32 value] (a view: writes land in the slots)."""
        per = self.rows_per_page * self.record_floats
        return self.io.slots[:, :per].view(self.cache_pages, self.rows_per_page, -1)

    # -- the row-store interface ------------------------------------------------------------
    def read_columns(self, idx: torch.Tensor, names: list[str] | None = None) -> dict:
        """{column: its rows `idx`} (copies; a width-0 column as shape [n])."""
        self.cache.load(self._pages(idx))
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
        self.cache.load(pages)
        where = self._record_index(idx)
        records = self._records()
        rows = records[where]
        for col, v in values.items():
            lo, width = self.offsets[col]
            rows[:, lo : lo + width] = v.reshape(-1, width).to(torch.float32)
        records[where] = rows
        self.cache.dirty.update(pages)

    def read_rows(self, idx: torch.Tensor) -> torch.Tensor:
        return self.read_columns(idx, [next(iter(self.columns))])[next(iter(self.columns))]

    def write_rows(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        self.write_columns(idx, {next(iter(self.columns)): rows})

    def prefetch(self, idx: torch.Tensor, device: torch.device, pin: bool = True) -> Future:
        """Queued on the host worker (behind every queued update): pin, then read."""
        return HOST_WORKER.submit(self._read_to, idx, device, pin)

    def _read_to(self, idx: torch.Tensor, device: torch.device, pin: bool):
        if pin:
            self.pin(idx, lookup=True)
        return self.read_rows(idx).to(device), None

    def page_in(self, idx: torch.Tensor) -> Future:
        """Queued on the host worker (behind every queued update): `page_in_now`."""
        return HOST_WORKER.submit(self.page_in_now, idx)

    def page_in_now(self, idx: torch.Tensor) -> None:
        """Start reading the uncached pages of rows `idx` on the I/O pool and return
        (page_cache.py, "Page-in ahead"); on the host worker, in program order."""
        self.cache.page_in(self._pages(idx))

    def pin(self, idx: torch.Tensor, lookup: bool = False) -> None:
        """`lookup`: a step's lookup (its pages count toward the cache hit rate)."""
        pages = self._pages(idx)
        self.cache.load(pages, lookup)
        self.pins_taken += 1
        self.cache.hold(pages)

    def release(self, idx: torch.Tensor) -> None:
        self.cache.release(self._pages(idx))

    def release_all(self) -> None:
        self.cache.release_all()

    def flush(self) -> None:
        """Write every dirty cached page back (they stay cached)."""
        self.cache.flush()

    def snapshot(self, name: str | None = None) -> torch.Tensor:
        """Column `name` (default the weight) of every row (the whole column in host memory:
        a checkpoint streams it with `read_range` instead, engram/rowstore/streamed_columns.py)."""
        return self.read_range(name or next(iter(self.columns)), 0, self.rows)

    def read_range(self, name: str, r0: int, n: int) -> torch.Tensor:
        """Column `name` of rows [r0, r0 + n), read page by page without touching the cache's
        order: cached pages (newer than the disk when dirty) from the cache, the others from
        disk into a scratch page. Counts the bytes it returns (`read_out_bytes`, the largest
        one read in `read_out_peak`)."""
        self.cache.settle(list(self.cache.writing))  # an evicted page's disk copy is current now
        lo, width = self.offsets[name]
        out = torch.empty(n, width, dtype=torch.float32)
        scratch = mmap.mmap(-1, self.page_bytes)
        per = self.rows_per_page * self.record_floats
        end = r0 + n
        for p in range(r0 // self.rows_per_page, -(-end // self.rows_per_page)):
            if p in self.cache.where:
                page = self.io.slots[self.cache.where[p], :per]
            else:
                self.io.read_page(p, scratch)
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
        self.io.close()  # drops the files' locks: a later sweep may remove them

    def remove_files(self) -> None:
        """Close and delete the page files (scratch)."""
        self.io.remove_files()
