"""The NVMe row store's page I/O: its page files, the cache's slot buffers, and the moves of
pages between them.

Files are opened with O_DIRECT where the file system allows it (tmpfs, some network file
systems do not: then buffered, with the reason logged once); buffers are page-aligned slots of
one anonymous mapping; a batch of page reads or write-backs runs as a task on a small thread
pool (so page-ins overlap the step): with O_DIRECT, by native Linux AIO (linux_aio.py: one
io_submit per 256 pages, one io_getevents for their completions), else one os.preadv /
os.pwritev per run of adjacent pages, the batch split over the pool's threads (they release
the GIL). Page p lives in file p % len(dirs) at offset (p // len(dirs)) x page_bytes: the pages
of a shard stripe over the directories (one per drive). A batch is a pair of int64 tensors
(pages, slots): no Python runs per page.

Pages never written hold zeros in the files (created empty, then allocated): reading one fills
its slot with zeros and reads nothing (`written`), so a fresh store's first touch of a page (the
init, a resume) costs no read. Every page written gets a checksum and every page read is checked
against it (page_sums.py): a page changed behind the store's back stops the run, naming the
file, the page, the table and its rows.

The I/O threads only move bytes between a slot they were given and the file; which page is in
which slot is the page cache's (page_cache.py). The files are created, locked, preallocated and,
when a killed run left them, swept by page_files.py; page I/O errors name the fix there.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engram.rowstore.linux_aio import DEPTH, AioContexts, aio_available
from engram.rowstore.page_files import create_page_file, page_io_error
from engram.rowstore.page_sums import PageChecksumError, page_sums
from engram.runtime import faults

__all__ = ["PageBuffer", "PageIO"]

log = logging.getLogger(__name__)

_NONE = torch.empty(0, dtype=torch.long)


class PageBuffer:
    """`n` page-aligned buffers of `page_bytes` (one anonymous mapping): `tensor` views them as
    [n, page_bytes / 4] fp32, `view(i)` as bytes for preadv / pwritev."""

    def __init__(self, n: int, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.mm = mmap.mmap(-1, max(1, n) * page_bytes)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.float32).view(-1, page_bytes // 4)

    def view(self, i: int) -> memoryview:
        return memoryview(self.mm)[i * self.page_bytes : (i + 1) * self.page_bytes]


class PageIO:
    """`pages` pages of `page_bytes` in page files under `dirs`, and `cache_pages` slots of
    host memory they move into and out of (see the module docstring). `rows_per_page`, `row0`
    (the shard's first row in the table) and `label` (the table) only name rows in errors."""

    def __init__(
        self,
        pages: int,
        page_bytes: int,
        cache_pages: int,
        dirs: list[str],
        name: str,
        threads: int,
        direct: bool,
        rows_per_page: int = 1,
        row0: int = 0,
        label: str = "",
    ) -> None:
        self.pages, self.page_bytes, self.label = pages, page_bytes, label or name
        self.rows_per_page, self.row0 = rows_per_page, row0
        self.fds, self.paths, reasons = [], [], set()
        self.aio = None  # native AIO batches (linux_aio.py): O_DIRECT files only
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
        self.buffered_why = "; ".join(sorted(reasons))  # empty with O_DIRECT
        for reason in sorted(reasons):
            log.warning("NVMe Engram table %s: buffered I/O: %s", name, reason)
        self.buffer = PageBuffer(cache_pages, self.page_bytes)  # the cache's slots
        self.slots = self.buffer.tensor
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="engram-nvme")
        no_aio = aio_available() if self.direct else "buffered I/O"
        if no_aio is None:
            self.aio = AioContexts()
        else:
            log.info("NVMe Engram table %s: page I/O by preadv / pwritev: %s", name, no_aio)
        self.engine = "native AIO" if no_aio is None else f"preadv / pwritev ({no_aio})"
        self.parallel = 1 if self.aio is not None else threads
        """Tasks a batch is best split into (native AIO: one; the kernel runs it in parallel)."""
        self.written = torch.zeros(pages, dtype=torch.bool)  # else the file holds zeros there
        self.sums = torch.zeros(pages, dtype=torch.int32)  # of the pages written (page_sums.py)
        self.reads = self.writes = 0  # pages moved, for tests and benchmarks
        self.reads_ahead = 0  # of `reads`, those of page-in tasks (`start`)

    # -- moves: synchronous, or a task on the pool -------------------------------------------
    def read_now(self, pages: torch.Tensor, slots: torch.Tensor, into: PageBuffer | None = None):
        """Read `pages` into rows `slots` of the slots (or of `into`) now; raise the first
        error."""
        self._run_now(_NONE, _NONE, pages, slots, into)

    def write_now(self, pages: torch.Tensor, slots: torch.Tensor) -> None:
        """Write `pages` back from their `slots` now; raise the first error."""
        self._run_now(pages, slots, _NONE, _NONE, None)

    def start(
        self, write_pages: torch.Tensor, write_slots: torch.Tensor,
        read_pages: torch.Tensor, read_slots: torch.Tensor,
    ) -> Future:  # fmt: skip
        """One task on the pool that writes pages back, then reads pages (a slot is reused only
        after its write); returns at once."""
        self.note_writes(write_pages)
        on_disk = int(self.written[read_pages].sum())
        self.reads += on_disk
        self.reads_ahead += on_disk
        return self._pool.submit(
            self._write_then_read, write_pages, write_slots, read_pages, read_slots, None
        )

    def _submit(self, wp, ws, rp, rs, into) -> list[Future]:
        """The moves as `parallel` tasks, each whole runs of adjacent pages (`shares`; writes
        before reads within each: callers of the synchronous moves never reuse a written slot
        in the same call)."""
        self.note_writes(wp)
        self.reads += int(self.written[rp].sum())
        w, r = self.shares(wp), self.shares(rp)
        return [
            self._pool.submit(
                self._write_then_read, wp[w == i], ws[w == i], rp[r == i], rs[r == i], into
            )
            for i in range(self.parallel)
            if bool((w == i).any() or (r == i).any())
        ]

    def shares(self, pages: torch.Tensor) -> torch.Tensor:
        """Which of the `parallel` tasks moves each page: whole runs of pages adjacent in one
        file (`runs`), dealt out in turn."""
        if self.parallel == 1 or not len(pages):
            return torch.zeros(len(pages), dtype=torch.long)
        n = len(self.fds)
        order = torch.argsort((pages % n) * self.pages + pages)  # by file, then offset
        p = pages[order]
        new = torch.ones(len(p), dtype=torch.bool)
        new[1:] = p[1:] != p[:-1] + n
        at = torch.arange(len(p))
        start = torch.cummax(torch.where(new, at, 0), 0).values
        run = torch.cumsum(new | ((at - start) % 64 == 0), 0) - 1
        out = torch.empty_like(pages)
        out[order] = run % self.parallel
        return out

    def note_writes(self, pages: torch.Tensor) -> None:
        """Pages about to be written back (on the caller's thread, in program order): counted,
        and no longer zeros in the files."""
        self.written[pages] = True
        self.writes += len(pages)

    def _run_now(self, wp, ws, rp, rs, into) -> None:
        """The moves now: on this thread (one native AIO batch), or split over the pool."""
        if self.parallel == 1:
            self.note_writes(wp)
            self.reads += int(self.written[rp].sum())
            return self._write_then_read(wp, ws, rp, rs, into)
        for task in self._submit(wp, ws, rp, rs, into):
            task.result()

    def _write_then_read(self, wp, ws, rp, rs, into: PageBuffer | None) -> None:
        if len(wp):
            self.sums[wp] = page_sums(self.slots, ws, wp)
            self._move(wp, ws, self.buffer, write=True)
        if len(rp):
            buf = into or self.buffer
            on_disk = self.written[rp]
            if not bool(on_disk.all()):  # never written: zeros, nothing to read
                buf.tensor[rs[~on_disk]] = 0.0
                rp, rs = rp[on_disk], rs[on_disk]
            self._move(rp, rs, buf, write=False)
            self._check(rp, rs, buf.tensor)

    def _check(self, pages: torch.Tensor, slots: torch.Tensor, buf: torch.Tensor) -> None:
        """Compare the pages read with their checksums; a mismatch stops the run, by name."""
        bad = torch.nonzero(page_sums(buf, slots, pages) != self.sums[pages]).view(-1)
        if not len(bad):
            return
        page = int(pages[bad[0]])
        fd_i, pos = page % len(self.fds), (page // len(self.fds)) * self.page_bytes
        r0 = self.row0 + page * self.rows_per_page
        raise PageChecksumError(
            f"NVMe Engram table {self.label}: page {page} of {self.paths[fd_i]} (bytes {pos}-"
            f"{pos + self.page_bytes - 1}; rows {r0}-{r0 + self.rows_per_page - 1} of the table) "
            f"is not what this run wrote there (checksum mismatch; {len(bad)} of {len(pages)} "
            "pages of this batch): the page file was changed or damaged behind the run (another "
            "process, a failing drive: dmesg, smartctl). The page files are scratch and the "
            "checkpoint is the record: resume from the last checkpoint (rows updated since it "
            "are lost with this run)."
        )

    def _move(self, pages: torch.Tensor, slots: torch.Tensor, buf: PageBuffer, write: bool):
        """Write (or read) `pages` from (into) rows `slots` of `buf`; on the I/O pool: native
        AIO batches where the store has them, else a preadv / pwritev per run of adjacent
        pages. An OSError names the file and the fix (page_files.page_io_error)."""
        if self.aio is not None:
            return self._move_aio(pages, slots, buf, write)
        move = os.pwritev if write else os.preadv
        for run in self.runs(pages, slots):
            page = run[0][0]
            fd, pos = self._file_pos(page)
            try:
                got = move(fd, [buf.view(slot) for _, slot in run], pos)
                if write and faults.armed("nvme.page_write"):
                    for _ in run:  # the test hook counts pages written
                        faults.point("nvme.page_write")
            except OSError as e:
                raise page_io_error(e, self.paths[page % len(self.fds)], write) from e
            if got != len(run) * self.page_bytes:
                raise OSError(f"short {'write' if write else 'read'} of pages: {got} B")

    def _move_aio(self, pages: torch.Tensor, slots: torch.Tensor, buf: PageBuffer, write):
        """`_move` by native AIO, one submission of up to linux_aio.DEPTH pages at a time (a
        kill or an error between them leaves the batch's later pages unwritten)."""
        files = pages % len(self.fds)
        fds = torch.tensor(self.fds, dtype=torch.int64)[files]
        offsets = (pages // len(self.fds)) * self.page_bytes
        addrs = buf.tensor.data_ptr() + slots * self.page_bytes
        counted = write and faults.armed("nvme.page_write")
        for lo in range(0, len(pages), DEPTH):
            part, at = slice(lo, lo + DEPTH), lo  # `at`: the page an error is about
            try:
                res = self.aio.run(fds[part], addrs[part], offsets[part], self.page_bytes, write)
                wrong = torch.nonzero(res != self.page_bytes).view(-1)
                done = int(wrong[0]) if len(wrong) else len(res)
                for i in range(done if counted else 0):  # the test hook counts pages written
                    at = lo + i
                    faults.point("nvme.page_write")
                if len(wrong):
                    at, r = lo + done, int(res[done])
                    if r < 0:
                        raise OSError(-r, os.strerror(-r))
                    raise OSError(
                        errno.EIO,
                        f"short {'write' if write else 'read'}: {r} of {self.page_bytes} B",
                    )
            except OSError as e:
                raise page_io_error(e, self.paths[int(files[at])], write) from e

    def runs(self, pages: torch.Tensor, slots: torch.Tensor) -> list[list[tuple[int, int]]]:
        """(page, slot) pairs as runs of pages adjacent in one file (one preadv / pwritev each,
        into or out of their scattered slots), at most 64 pages a run."""
        if not len(pages):
            return []
        n = len(self.fds)
        t = torch.stack([pages, slots], 1)
        t = t[torch.argsort((t[:, 0] % n) * self.pages + t[:, 0])]  # by file, then offset
        new = torch.ones(len(t), dtype=torch.bool)
        new[1:] = t[1:, 0] != t[:-1, 0] + n
        at = torch.arange(len(t))
        start = torch.cummax(torch.where(new, at, 0), 0).values
        cuts = torch.nonzero(new | ((at - start) % 64 == 0)).view(-1).tolist() + [len(t)]
        pairs = [tuple(j) for j in t.tolist()]
        return [pairs[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    def _file_pos(self, page: int) -> tuple[int, int]:
        return self.fds[page % len(self.fds)], (page // len(self.fds)) * self.page_bytes

    def close(self) -> None:
        self._pool.shutdown()
        if self.aio is not None:
            self.aio.close()
        for fd in self.fds:
            os.close(fd)  # drops the file's lock: a later sweep may remove it
        self.fds = []

    def remove_files(self) -> None:
        """Close and delete the page files (scratch)."""
        if self.aio is not None:
            self.aio.close()
        for fd in self.fds:
            os.close(fd)
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.fds, self.paths = [], []
