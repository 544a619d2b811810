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

from concurrent.futures import Future

import torch

from engram.rowstore.host_worker import HOST_WORKER
from engram.rowstore.interface import ColumnRowStore
from engram.rowstore.linux_aio import DEPTH
from engram.rowstore.page_cache import PageCache
from engram.rowstore.page_io import PageBuffer, PageIO

__all__ = ["INDEX_BYTES_PER_PAGE", "PAGE_BYTES", "NvmeRowStore", "page_layout"]

PAGE_BYTES = 4096  # the logical block size O_DIRECT aligns offsets, lengths and buffers to
INDEX_BYTES_PER_PAGE = 10
"""Host memory a store keeps per page of its files besides the cache: the page's slot (int32,
page_cache.py), its checksum (int32), whether it was ever written and whether its write-back is
in flight (a bool each)."""


def page_layout(record_bytes: int) -> tuple[int, int]:
    """(page_bytes, rows_per_page) for records of `record_bytes`: whole records per 4 KiB page,
    or one record per page of the next multiple of 4 KiB."""
    page = PAGE_BYTES * max(1, -(-record_bytes // PAGE_BYTES))
    return page, page // record_bytes


class NvmeRowStore(ColumnRowStore):
    """Rows [rows, columns...] of one shard in page files under `dirs`, cached in `cache_bytes`
    of host memory (see the module docstring). `columns`: name -> width in fp32 values (0: one
    value per row, read as shape [n]); the first is the weight. `name` names its files; `label`
    (the table's name in the model) and `row0` (the shard's first row in the table) name its
    rows in errors."""

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
        label: str = "",
        row0: int = 0,
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
        self.io = PageIO(
            self.pages, self.page_bytes, self.cache_pages, dirs, name, threads, direct,
            self.rows_per_page, row0, label or name,
        )  # fmt: skip
        self.cache = PageCache(self.io, self.pages, self.cache_pages)
        self.pins_taken = 0
        self.read_out_bytes = self.read_out_peak = 0  # columns read out (checkpoints)
        self.read_out_pages = 0  # pages read from the files for those (`read_range`)

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
        return len(self.cache.cached()) * self.page_bytes

    def io_counters(self) -> dict[str, float]:
        """Cumulative page I/O since the store was made (engram/train/telemetry.py logs their
        growth per log window): pages read on demand and ahead (pages never written are not
        read: page_io.py), pages written back, pages the step's lookups pinned and of them
        those already resident (cached or read ahead), seconds loads waited for page-ins still
        in flight, bytes moved; pages read out for checkpoints (`read_range`), apart."""
        c, io = self.cache, self.io
        return {
            "pages_read_demand": io.reads - io.reads_ahead - self.read_out_pages,
            "pages_read_ahead": io.reads_ahead,
            "pages_read_out": self.read_out_pages,
            "pages_written": io.writes,
            "lookup_pages": c.lookup_pages,
            "lookup_hits": c.lookup_hits,
            "page_in_wait_s": c.page_in_wait_s,
            "bytes_moved": (io.reads + io.writes) * self.page_bytes,
        }

    # -- records --------------------------------------------------------------------------
    def _pages(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.unique(idx.to("cpu", torch.long) // self.rows_per_page)

    def _record_index(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache slot, record within the page) of each row of `idx` (its page is cached)."""
        idx = idx.to("cpu", torch.long)
        return self.cache.slot_of[idx // self.rows_per_page], idx % self.rows_per_page

    def _records(self, slots: torch.Tensor | None = None) -> torch.Tensor:
        """The cache (or `slots` of it: a copy) as [slot, record, fp32 value] (a view: writes
        land in the slots)."""
        per = self.rows_per_page * self.record_floats
        pages = self.io.slots if slots is None else self.io.slots[slots]
        return pages[:, :per].view(len(pages), self.rows_per_page, self.record_floats)

    def _whole_pages(self, idx: torch.Tensor, names) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(pages of rows `idx`, which of them a write of columns `names` to rows `idx`
        overwrites whole: every column of every row they hold; None when none can be)."""
        if set(names) != set(self.columns):
            return self._pages(idx), None
        pages, counts = torch.unique(
            idx.to("cpu", torch.long) // self.rows_per_page, return_counts=True
        )
        held = (self.rows - pages * self.rows_per_page).clamp(max=self.rows_per_page)
        return pages, counts == held

    # -- the row-store interface ------------------------------------------------------------
    def read_columns(self, idx: torch.Tensor, names: list[str] | None = None) -> dict:
        """{column: its rows `idx`} (copies; a width-0 column as shape [n])."""
        self.cache.load(self._pages(idx))
        return self._gather(idx, names)

    def _gather(self, idx: torch.Tensor, names: list[str] | None = None) -> dict:
        """read_columns of rows whose pages are cached."""
        rec = self._records()[self._record_index(idx)]
        out = {}
        for col in names or list(self.columns):
            lo, width = self.offsets[col]
            values = rec[:, lo : lo + width].clone()
            out[col] = values.squeeze(1) if self.columns[col] == 0 else values
        return out

    def write_columns(self, idx: torch.Tensor, values: dict) -> None:
        """Overwrite columns of rows `idx` (unique) with `values` {column: [n, width] or [n]};
        pages it overwrites whole are not read first."""
        pages, whole = self._whole_pages(idx, values)
        self.cache.load(pages, overwrite=whole)
        where = self._record_index(idx)
        records = self._records()
        if len(values) == len(self.columns):  # whole records: one scatter
            rows = torch.cat(
                [
                    values[c].reshape(-1, max(1, w)).to(torch.float32)
                    for c, w in self.columns.items()
                ],
                dim=1,
            )
            records[where] = rows
        else:
            rows = records[where]
            for col, v in values.items():
                lo, width = self.offsets[col]
                rows[:, lo : lo + width] = v.reshape(-1, width).to(torch.float32)
            records[where] = rows
        self.cache.mark_dirty(pages)

    def read_rows(self, idx: torch.Tensor) -> torch.Tensor:
        return self.read_columns(idx, [next(iter(self.columns))])[next(iter(self.columns))]

    def write_rows(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        self.write_columns(idx, {next(iter(self.columns)): rows})

    def prefetch(self, idx: torch.Tensor, device: torch.device, pin: bool = True) -> Future:
        """Queued on the host worker (behind every queued update): pin, then read."""
        return HOST_WORKER.submit(self._read_to, idx, device, pin)

    def _read_to(self, idx: torch.Tensor, device: torch.device, pin: bool):
        pages = self._pages(idx)
        self.cache.load(pages, lookup=pin)  # a pinned read is a step's lookup
        if pin:
            self.pins_taken += 1
            self.cache.hold(pages)
        weight = next(iter(self.columns))
        return self._gather(idx, [weight])[weight].to(device), None

    def page_in(self, idx: torch.Tensor) -> Future:
        """Queued on the host worker (behind every queued update): `page_in_now`."""
        return HOST_WORKER.submit(self.page_in_now, idx)

    def page_in_now(self, idx: torch.Tensor) -> None:
        """Start reading the uncached pages of rows `idx` on the I/O pool and return
        (page_cache.py, "Page-in ahead"); on the host worker, in program order."""
        self.cache.page_in(self._pages(idx))

    def pin(self, idx: torch.Tensor) -> None:
        pages = self._pages(idx)
        self.cache.load(pages)
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
        """Column `name` of rows [r0, r0 + n), read without touching the cache's order: cached
        pages (newer than the disk when dirty) from the cache, the others from disk into
        scratch pages, `DEPTH` at a time. Counts the bytes it returns (`read_out_bytes`, the
        largest one read in `read_out_peak`)."""
        self.cache.settle()  # page-ins done, write-backs on disk: the disk copy is current
        lo, width = self.offsets[name]
        out = torch.empty(n, width, dtype=torch.float32)
        rpp, end = self.rows_per_page, r0 + n
        scratch = PageBuffer(min(DEPTH, -(-end // rpp) - r0 // rpp), self.page_bytes)
        for p0 in range(r0 // rpp, -(-end // rpp), DEPTH):
            pages = torch.arange(p0, min(p0 + DEPTH, -(-end // rpp)))
            slots = self.cache.slot_of[pages]
            on_disk = slots < 0
            reads = self.io.reads
            self.io.read_now(pages[on_disk], torch.arange(int(on_disk.sum())), into=scratch)
            self.read_out_pages += self.io.reads - reads
            records = torch.empty(len(pages), rpp, self.record_floats)
            records[~on_disk] = self._records(slots[~on_disk])
            per = rpp * self.record_floats
            records[on_disk] = scratch.tensor[: int(on_disk.sum()), :per].view(
                -1, rpp, self.record_floats
            )
            a, b = max(r0, p0 * rpp), min(end, (p0 + len(pages)) * rpp)
            first = a - p0 * rpp
            out[a - r0 : b - r0] = records.view(-1, self.record_floats)[
                first : first + b - a, lo : lo + width
            ]
        self.read_out_bytes += out.nbytes
        self.read_out_peak = max(self.read_out_peak, out.nbytes)
        return out.squeeze(1) if self.columns[name] == 0 else out

    def load(self, values: dict, chunk_rows: int | None = None, row0: int = 0) -> None:
        """Write columns {name: [n, width] or [n]} into rows [row0, row0 + n) (a fresh init,
        a resume; default all rows), through the cache in chunks of at most half of it, cut at
        page boundaries: pages written whole (every column) or never written before are not
        read first (page_io.py: a fresh store's pages are zeros)."""
        n = len(next(iter(values.values()))) if values else 0
        chunk_pages = max(
            1, (chunk_rows or self.cache_pages // 2 * self.rows_per_page) // self.rows_per_page
        )
        a = row0
        while a < row0 + n:
            b = min(row0 + n, (a // self.rows_per_page + chunk_pages) * self.rows_per_page)
            idx = torch.arange(a, b)
            self.write_columns(idx, {k: v[a - row0 : b - row0] for k, v in values.items()})
            a = b

    def close(self) -> None:
        self.io.close()  # drops the files' locks: a later sweep may remove them

    def remove_files(self) -> None:
        """Close and delete the page files (scratch)."""
        self.io.remove_files()
