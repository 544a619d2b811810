"""The NVMe row store's page I/O: its page files, the cache's slot buffers, and the moves of
pages between them.

Files are opened with O_DIRECT where the file system allows it (tmpfs, some network file
systems do not: then buffered, with the reason logged once); buffers are page-aligned slots of
one anonymous mapping; a batch of page reads or write-backs runs as a task on a small thread
pool (so page-ins overlap the step): with O_DIRECT, by native Linux AIO (linux_aio.py: one
io_submit per 256 pages, one io_getevents for their completions), else one os.preadv /
os.pwritev per run of adjacent pages, the batch split over the pool's threads (they release
the GIL). Page p lives in file p % len(dirs) at offset (p // len(dirs)) x page_bytes: the pages
of a shard stripe over the directories (one per drive).

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
from engram.runtime import faults

__all__ = ["PageIO"]

log = logging.getLogger(__name__)

Jobs = list[tuple[int, int]]  # (page, slot)


class PageIO:
    """`pages` pages of `page_bytes` in page files under `dirs`, and `cache_pages` slots of
    host memory they move into and out of (see the module docstring)."""

    def __init__(
        self,
        pages: int,
        page_bytes: int,
        cache_pages: int,
        dirs: list[str],
        name: str,
        threads: int,
        direct: bool,
    ) -> None:
        self.pages, self.page_bytes = pages, page_bytes
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
        self._buf = mmap.mmap(-1, cache_pages * self.page_bytes)  # page-aligned slots
        self.slots = torch.frombuffer(self._buf, dtype=torch.float32).view(
            cache_pages, self.page_bytes // 4
        )
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="engram-nvme")
        no_aio = aio_available() if self.direct else "buffered I/O"
        if no_aio is None:
            self.aio = AioContexts()
        else:
            log.info("NVMe Engram table %s: page I/O by preadv / pwritev: %s", name, no_aio)
        self.engine = "native AIO" if no_aio is None else f"preadv / pwritev ({no_aio})"
        self.reads = self.writes = 0  # pages moved, for tests and benchmarks

    def _file_pos(self, page: int) -> tuple[int, int]:
        return self.fds[page % len(self.fds)], (page // len(self.fds)) * self.page_bytes

    def _view(self, slot: int) -> memoryview:
        return memoryview(self._buf)[slot * self.page_bytes : (slot + 1) * self.page_bytes]

    def runs(self, jobs: Jobs) -> list[Jobs]:
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

    def _move(self, runs: list[Jobs], write: bool) -> None:
        """Write (or read) runs of pages from (into) their slots; runs on the I/O pool: one
        batch of native AIO (linux_aio.py) where the store has it, else a preadv / pwritev per
        run. An OSError names the file and the fix (page_files.page_io_error)."""
        if self.aio is not None:
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

    def _move_aio(self, jobs: Jobs, write: bool) -> None:
        """`_move` by native AIO, one submission of up to linux_aio.DEPTH pages at a time (a
        kill or an error between them leaves the batch's later pages unwritten)."""
        t = torch.tensor(jobs, dtype=torch.int64).view(-1, 2)
        files = t[:, 0] % len(self.fds)
        fds = torch.tensor(self.fds, dtype=torch.int64)[files]
        offsets = (t[:, 0] // len(self.fds)) * self.page_bytes
        addrs = self.slots.data_ptr() + t[:, 1] * self.page_bytes
        for lo in range(0, len(jobs), DEPTH):
            part, at = slice(lo, lo + DEPTH), lo  # `at`: the page an error is about
            try:
                res = self.aio.run(fds[part], addrs[part], offsets[part], self.page_bytes, write)
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

    def shares(self, runs: list) -> list[list]:
        """The runs split among the I/O threads (with native AIO one task submits them all:
        the kernel runs them in parallel)."""
        threads = 1 if self.aio is not None else self._pool._max_workers
        return [runs[i::threads] for i in range(min(threads, len(runs)))]

    def move_now(self, jobs: Jobs, write: bool) -> None:
        """Read (or write back) pages (page, slot) on the thread pool, a share of the runs of
        adjacent pages per thread (a future per page costs more than its 4 KiB read); raise the
        first error."""
        shares = self.shares(self.runs(jobs))
        for _ in self._pool.map(lambda share: self._move(share, write), shares):
            pass
        if write:
            self.writes += len(jobs)
        else:
            self.reads += len(jobs)

    def start(self, writes: Jobs, reads: list[Jobs]) -> Future:
        """One task on the pool that writes `writes` back, then reads the runs `reads` (a slot
        is reused only after its write); returns at once."""
        task = self._pool.submit(self._write_then_read, self.runs(writes), reads)
        self.writes += len(writes)
        self.reads += sum(len(run) for run in reads)
        return task

    def _write_then_read(self, writes: list, reads: list) -> None:
        self._move(writes, write=True)
        self._move(reads, write=False)

    def read_page(self, page: int, into: mmap.mmap) -> None:
        """Page `page` from its file into the page-sized buffer `into` (now, on this thread)."""
        fd, pos = self._file_pos(page)
        os.preadv(fd, [into], pos)

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
