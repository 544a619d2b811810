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
one anonymous mapping; a batch of page reads or write-backs runs as a task on a small thread
pool (so page-ins overlap the step): with O_DIRECT, by native Linux AIO (linux_aio.py: one
io_submit per 256 pages, one io_getevents for their completions), else one os.preadv /
os.pwritev per run of adjacent pages, the batch split over the pool's threads (they release
the GIL).

Cache. `cache_bytes` of page slots, least recently used first out; a dirty page is written back
when it is evicted (and by `flush`). `pin(idx)` loads the pages of rows `idx` and holds them
until `release(idx)`: a step's rows stay in host memory from prefetch to their last use, so
reads and updates never wait on the disk mid-step. A pin that cannot fit the cache is refused,
naming the setting to raise. The store is not thread-safe: the tables use it from the one FIFO
host worker (engram/rowstore/host_worker.py).

Page-in ahead. `page_in(idx)` (queued on the worker while step N computes, with step N+1's
rows) starts reading the uncached pages of rows `idx` into free or evicted slots on the I/O pool
and returns at once; the reads (and the write-backs of the dirty pages they evict) overlap the
step. Why the rows a step sees stay exactly those of the device tier:

- Every cache-state mutation (which page is in which slot, dirty, pinned, loading, being
  written back) happens on the one FIFO worker, in program order with every read and update;
  the I/O threads only move bytes between a slot they were given and the file.
- A page missing from the cache has its latest value on disk, or on its way there: an evicted
  dirty page is in `_writing` until its write-back completes, and anything that needs it again
  (a load, a page-in, `snapshot`) waits for that write first, so it never reads stale bytes.
- A page being read (`_loading`) is in neither the cache map nor the free list: nothing evicts
  it, writes it or reads its slot; the first load, pin, read or write of it waits for its read
  and only then maps it. Its disk value is final: it was not cached, so no update could change
  it, and no update can run on it before its read completes.
- A page-in evicts only unpinned pages that it does not itself page in: the pages of step N
  (pinned by step N's prefetch, which is queued before the page-in) stay, and its victims'
  contents are final when chosen (every earlier job has run; a later job that wants the page
  loads it again, after the write-back). Evicting a page step N updates without a pin would
  cost a re-read, not a wrong value.
- A page-in is only a hint: it pages in what the free and evictable slots allow, and never
  fails for room; the rest is paged in when the step's pins end (`release_all`, after its
  update: those pages can be evicted then), and the next step's pin loads whatever is still
  missing.

The files are scratch space: a checkpoint saves the columns as tensors through DCP like host
tables, read out chunk by chunk (`read_range`, engram/checkpoint/streamed_dcp.py), and a resume
writes them back (`load` at a row offset). They are created, locked, preallocated and, when a
killed run left them, swept by page_files.py; page I/O errors name the fix there.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engram.rowstore.host_worker import HOST_WORKER
from engram.rowstore.linux_aio import DEPTH, AioContexts, aio_available
from engram.rowstore.memory import RowStore
from engram.rowstore.page_files import create_page_file, page_io_error
from engram.runtime import faults

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
        self._aio = None  # native AIO batches (linux_aio.py): O_DIRECT files only
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
        self._loading: dict[int, tuple[int, Future]] = {}  # page -> (slot, its read): page_in
        self._writing: dict[int, Future] = {}  # evicted page -> its write-back (page_in)
        self._ahead: list[int] = []  # the pages of the last page_in (kept by its evictions)
        self._ahead_rest: list[int] = []  # those it had no room for yet
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="engram-nvme")
        no_aio = aio_available() if self.direct else "buffered I/O"
        if no_aio is None:
            self._aio = AioContexts()
        else:
            log.info("NVMe Engram table %s: page I/O by preadv / pwritev: %s", name, no_aio)
        self.reads = self.writes = 0  # pages moved, for tests and benchmarks
        self.pins_taken = 0
        self.read_out_bytes = self.read_out_peak = 0  # columns read out (checkpoints)
        self.paged_in = 0  # pages read ahead by page_in
        self.page_in_waits = 0  # page-ins still in flight when a load needed the page

    # -- pages ---------------------------------------------------------------------------
    def _file_pos(self, page: int) -> tuple[int, int]:
        return self.fds[page % len(self.fds)], (page // len(self.fds)) * self.page_bytes

    def _view(self, slot: int) -> memoryview:
        return memoryview(self._buf)[slot * self.page_bytes : (slot + 1) * self.page_bytes]

    def _runs(self, jobs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """(page, slot) jobs as runs of pages adjacent in one file (one preadv / pwritev each,
        into or out of their scattered slots), at most 64 pages a run."""
        if not jobs:
            return []
        n, t = len(self.fds), torch.tensor(jobs, dtype=torch.long).view(-1, 2)
        t = t[torch.argsort((t[:, 0] % n) * self.pages + t[:, 0])]  # by file, then offset
        new = torch.ones(len(t), dtype=torch.bool)
        new[1:] = t[1:, 0] != t[:-1, 0] + n
        at = torch.arange(len(t))
        start = torch.cummax(torch.where(new, at, 0), 0).values
        cuts = torch.nonzero(new | ((at - start) % 64 == 0)).view(-1).tolist() + [len(t)]
        pairs = [tuple(j) for j in t.tolist()]
        return [pairs[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    def _move(self, runs: list[list[tuple[int, int]]], write: bool) -> None:
        """Write (or read) runs of pages from (into) their slots; runs on the I/O pool: one
        batch of native AIO (linux_aio.py) where the store has it, else a preadv / pwritev per
        run. An OSError names the file and the fix (page_files.page_io_error)."""
        if self._aio is not None:
            return self._move_aio([job for run in runs for job in run], write)
        move = os.pwritev if write else os.preadv
        for run in runs:
            page = run[0][0]
            fd, pos = self._file_pos(page)
            try:
                done = move(fd, [self._view(slot) for _, slot in run], pos)
                if write:
                    for _ in run:  # the test hook counts pages written
                        faults.point("nvme.page_write")
            except OSError as e:
                raise page_io_error(e, self.paths[page % len(self.fds)], write) from e
            if done != len(run) * self.page_bytes:
                raise OSError(f"short {'write' if write else 'read'} of pages: {done} B")

    def _move_aio(self, jobs: list[tuple[int, int]], write: bool) -> None:
        """`_move` by native AIO, one submission of up to linux_aio.DEPTH pages at a time (a
        kill or an error between them leaves the batch's later pages unwritten)."""
        t = torch.tensor(jobs, dtype=torch.int64).view(-1, 2)
        files = t[:, 0] % len(self.fds)
        fds = torch.tensor(self.fds, dtype=torch.int64)[files]
        offsets = (t[:, 0] // len(self.fds)) * self.page_bytes
        addrs = self._slots.data_ptr() + t[:, 1] * self.page_bytes
        for lo in range(0, len(jobs), DEPTH):
            part, at = slice(lo, lo + DEPTH), lo  # `at`: the page an error is about
            try:
                res = self._aio.run(fds[part], addrs[part], offsets[part], self.page_bytes, write)
                for i, r in enumerate(res.tolist()):
                    at = lo + i
                    if r < 0:
                        raise OSError(-r, os.strerror(-r))
                    if r != self.page_bytes:
                        raise OSError(
                            errno.EIO,
                            f"short {'write' if write else 'read'}: {r} of {self.page_bytes} B",
                        )
                    if write:  # the test hook counts pages written
                        faults.point("nvme.page_write")
            except OSError as e:
                raise page_io_error(e, self.paths[int(files[at])], write) from e

    def _shares(self, runs: list) -> list[list]:
        """The runs split among the I/O threads (with native AIO one task submits them all:
        the kernel runs them in parallel)."""
        threads = 1 if self._aio is not None else self._pool._max_workers
        return [runs[i::threads] for i in range(min(threads, len(runs)))]

    def _io(self, jobs: list[tuple[int, int]], write: bool) -> None:
        """Read (or write back) pages (page, slot) on the thread pool, a share of the runs of
        adjacent pages per thread (a future per page costs more than its 4 KiB read); raise the
        first error."""
        shares = self._shares(self._runs(jobs))
        for _ in self._pool.map(lambda share: self._move(share, write), shares):
            pass
        if write:
            self.writes += len(jobs)
        else:
            self.reads += len(jobs)

    def _settle(self, pages) -> None:
        """Wait for the page-in reads and write-backs of `pages` (their errors raise here); the
        pages read become cached (most recently used)."""
        mapped, slots, done = [], [], set()  # a task moves many pages: check it once
        for p in pages:
            if p in self._writing:
                write = self._writing.pop(p)
                if write not in done:
                    write.result()
                    done.add(write)
            if p in self._loading:
                slot, read = self._loading.pop(p)
                if read not in done:
                    if not read.done():
                        self.page_in_waits += 1
                    read.result()
                    done.add(read)
                self._where[p] = slot
                mapped.append(p)
                slots.append(slot)
        self._map(mapped, slots)

    def _map(self, pages: list[int], slots: list[int] | int) -> None:
        """The slot-of-page tensor for `pages` (one index op: per-page tensor writes cost us)."""
        if pages:
            self._slot_of[torch.tensor(pages)] = torch.tensor(slots)

    def _reap(self) -> None:
        """Settle the page-in reads and write-backs that have finished."""
        self._settle([p for p, f in self._writing.items() if f.done()])
        self._settle([p for p, (_, f) in self._loading.items() if f.done()])

    def _victims(self, need: int, keep: set[int]) -> list[int]:
        """Up to `need` cached pages to evict, least recently used first: never a pinned page
        nor one of `keep`."""
        victims = []
        for p in self._where if need > 0 else ():
            if p not in self._pins and p not in keep:
                victims.append(p)
                if len(victims) == need:
                    break
        return victims

    def page_in(self, idx: torch.Tensor) -> Future:
        """Queued on the host worker (behind every queued update): `page_in_now`."""
        return HOST_WORKER.submit(self.page_in_now, idx)

    def page_in_now(self, idx: torch.Tensor) -> None:
        """Start reading the uncached pages of rows `idx` on the I/O pool and return (see the
        module docstring, "Page-in ahead"); on the host worker, in program order."""
        self._ahead = self._pages(idx)
        self._page_in(self._ahead)

    def _page_in(self, pages: list[int]) -> None:
        """page_in_now's pages; what does not fit now (the step before still pins its pages)
        is paged in at the next `release_all` (the end of that step's update)."""
        self._reap()
        self._settle([p for p in pages if p in self._writing])  # read it after its write-back
        missing = [p for p in pages if p not in self._where and p not in self._loading]
        victims = self._victims(len(missing) - len(self._free), set(self._ahead))
        fits = len(self._free) + len(victims)
        missing, self._ahead_rest = missing[:fits], missing[fits:]
        if not missing:
            return
        cut = len(self._free) - min(len(missing), len(self._free))
        free, taken = self._free[cut:], []
        del self._free[cut:]
        for victim in victims:
            taken.append((victim, self._where.pop(victim), victim in self._dirty))
            self._dirty.discard(victim)
        self._map(victims, -1)
        # A share (one task) reads its runs into free slots first, then into its own victims'
        # slots, after writing those victims back: a slot is reused only after its write.
        for share in self._shares(self._runs([(p, -1) for p in missing])):
            reads, writes = [], []
            for run in share:
                placed = []
                for page, _ in run:
                    if free:
                        slot = free.pop()
                    else:
                        victim, slot, dirty = taken.pop()
                        if dirty:
                            writes.append((victim, slot))
                    placed.append((page, slot))
                reads.append(placed)
            task = self._pool.submit(self._write_then_read, self._runs(writes), reads)
            for page, _ in writes:
                self._writing[page] = task
            for run in reads:
                for page, slot in run:
                    self._loading[page] = (slot, task)
            self.writes += len(writes)
        self.reads += len(missing)
        self.paged_in += len(missing)

    def _write_then_read(self, writes: list, reads: list) -> None:
        self._move(writes, write=True)
        self._move(reads, write=False)

    def _load(self, pages: list[int]) -> None:
        """Bring `pages` into the cache (LRU unpinned pages out, dirty ones written back)."""
        if self._loading or self._writing:
            self._reap()
            self._settle(pages)  # being read ahead or written back: wait for it
        missing = [p for p in pages if p not in self._where]
        for p in pages:
            if p in self._where:
                self._where.move_to_end(p)
        if not missing:
            return
        need, needed = len(missing) - len(self._free), set(pages)
        victims = self._victims(need, needed)
        if len(victims) < need and self._loading:  # page-ins hold slots: finish them first
            self._settle(list(self._loading))
            victims = self._victims(need, needed)
        if len(victims) < need:
            raise RuntimeError(
                f"NVMe Engram table: {len(missing) + len(self._where)} pages pinned or needed "
                f"at once but the host cache holds {self.cache_pages} ({self.page_bytes} B "
                "each): raise engram.nvme_host_cache_gib (a step's rows must fit)"
            )
        evict = []
        self._map(victims, -1)
        for victim in victims:
            slot = self._where.pop(victim)
            if victim in self._dirty:
                evict.append((victim, slot))
                self._dirty.discard(victim)
            self._free.append(slot)
        self._io(evict, write=True)
        jobs = [(p, self._free.pop()) for p in missing]
        self._io(jobs, write=False)
        for p, slot in jobs:
            self._where[p] = slot
        self._map(missing, [slot for _, slot in jobs])

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
        if self._ahead_rest:  # the pages a page-in had no room for while they were pinned
            self._page_in(self._ahead_rest)

    def flush(self) -> None:
        """Write every dirty cached page back (they stay cached)."""
        self._io([(p, self._where[p]) for p in sorted(self._dirty)], write=True)
        self._dirty.clear()

    def snapshot(self, name: str | None = None) -> torch.Tensor:
        """Column `name` (default the weight) of every row (the whole column in host memory:
        a checkpoint streams it with `read_range` instead, engram/rowstore/streamed_columns.py)."""
        return self.read_range(name or next(iter(self.columns)), 0, self.rows)

    def read_range(self, name: str, r0: int, n: int) -> torch.Tensor:
        """Column `name` of rows [r0, r0 + n), read page by page without touching the cache's
        order: cached pages (newer than the disk when dirty) from the cache, the others from
        disk into a scratch page. Counts the bytes it returns (`read_out_bytes`, the largest
        one read in `read_out_peak`)."""
        self._settle(list(self._writing))  # an evicted page's disk copy is current after this
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
        if self._aio is not None:
            self._aio.close()
        for fd in self.fds:
            os.close(fd)  # drops the file's lock: a later sweep may remove it
        self.fds = []

    def remove_files(self) -> None:
        """Close and delete the page files (scratch)."""
        if self._aio is not None:
            self._aio.close()
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
