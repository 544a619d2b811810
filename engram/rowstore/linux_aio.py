"""Batched page I/O with Linux native AIO (io_submit / io_getevents), through libc's `syscall`:
no new dependency (libaio is not needed) and no compiled code.

Why: the NVMe store moves thousands of scattered 4 KiB pages a step. One `preadv` / `pwritev`
per page costs a syscall, a Python call and a blocking wait each (on the development machine
~17 us of CPU per O_DIRECT page, on the cores the step computes on); one `io_submit` of a few
hundred pages and one `io_getevents` for their completions cost ~4 us of CPU a page and keep
the drive's queue full (benchmarks/bench_page_io.py, docs/benchmarks.md).
The iocbs are built as one int64 tensor, not per page in Python.

Only with O_DIRECT files (buffered AIO runs synchronously inside io_submit) and only where the
kernel offers it (`aio_available`): otherwise the store keeps its preadv / pwritev path.
Known syscall numbers: x86_64 and aarch64 (Ascend's Kunpeng hosts).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import queue
import sys

import torch

__all__ = ["AioContexts", "aio_available"]

_SYSCALLS = {  # io_setup, io_destroy, io_submit, io_getevents
    "x86_64": (206, 207, 209, 208),
    "aarch64": (0, 1, 2, 4),
}
_PREAD, _PWRITE = 0, 1  # IOCB_CMD_PREAD / IOCB_CMD_PWRITE
DEPTH = 256  # iocbs submitted (and waited for) at a time, per context


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


def _numbers() -> tuple[int, int, int, int] | None:
    if not sys.platform.startswith("linux"):
        return None
    return _SYSCALLS.get(platform.machine())


def _call(number: int, *args) -> int:
    """A raw syscall; retried on EINTR; raises OSError on failure."""
    while True:
        r = _LIBC.syscall(ctypes.c_long(number), *args)
        if r >= 0:
            return r
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


def aio_available() -> str | None:
    """None if native AIO works here, else why not (for the store's log line)."""
    numbers = _numbers()
    if numbers is None:
        return f"no native AIO syscall numbers for {sys.platform} / {platform.machine()}"
    ctx = ctypes.c_ulong(0)
    try:
        _call(numbers[0], ctypes.c_long(DEPTH), ctypes.byref(ctx))
    except OSError as e:  # ENOSYS: not built in; EAGAIN: fs.aio-max-nr reached
        return f"io_setup failed: {e}"
    _call(numbers[1], ctx)
    return None


class AioContexts:
    """A pool of AIO contexts, one per I/O thread at a time (a context is not shared by
    concurrent waiters); `run` moves a batch of pages, `close` destroys them."""

    def __init__(self) -> None:
        numbers = _numbers()
        if numbers is None:
            raise OSError(errno.ENOSYS, "native AIO is not available here")
        self._setup, self._destroy, self._submit, self._getevents = numbers
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._all: list[ctypes.c_ulong] = []

    def _take(self) -> ctypes.c_ulong:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            ctx = ctypes.c_ulong(0)
            _call(self._setup, ctypes.c_long(DEPTH), ctypes.byref(ctx))
            self._all.append(ctx)
            return ctx

    def run(
        self, fds: torch.Tensor, addrs: torch.Tensor, offsets: torch.Tensor, nbytes: int,
        write: bool,
    ) -> torch.Tensor:  # fmt: skip
        """Read (write) `nbytes` at file offsets `offsets` of `fds` into (from) host addresses
        `addrs` (int64 tensors, one entry an I/O); returns each I/O's result (bytes moved, or
        -errno), after every submitted I/O has completed (its buffer is free again)."""
        n = len(fds)
        cbs = torch.zeros(n, 8, dtype=torch.int64)  # struct iocb, 64 B (linux/aio_abi.h)
        cbs[:, 0] = torch.arange(n)  # aio_data: the I/O's index
        cbs[:, 2] = (_PWRITE if write else _PREAD) | (fds.to(torch.int64) << 32)  # opcode, fd
        cbs[:, 3], cbs[:, 4], cbs[:, 5] = addrs, nbytes, offsets  # buf, nbytes, offset
        ptrs = cbs.data_ptr() + 64 * torch.arange(n, dtype=torch.int64)
        events = torch.zeros(DEPTH, 4, dtype=torch.int64)  # struct io_event: data, obj, res, res2
        results = torch.zeros(n, dtype=torch.int64)
        ctx = self._take()
        try:
            for lo in range(0, n, DEPTH):
                count = min(DEPTH, n - lo)
                submitted, error = 0, None
                while submitted < count and error is None:
                    try:
                        submitted += _call(
                            self._submit, ctx, ctypes.c_long(count - submitted),
                            ctypes.c_void_p(ptrs.data_ptr() + 8 * (lo + submitted)),
                        )  # fmt: skip
                    except OSError as e:  # the first unsubmitted iocb was refused
                        error = e
                done = 0
                while done < submitted:  # wait for what is in flight before any raise
                    got = _call(
                        self._getevents, ctx, ctypes.c_long(submitted - done),
                        ctypes.c_long(min(DEPTH, submitted - done)),
                        ctypes.c_void_p(events.data_ptr()), None,
                    )  # fmt: skip
                    results[events[:got, 0]] = events[:got, 2]
                    done += got
                if error is not None:
                    raise error
        finally:
            self._idle.put(ctx)
        return results

    def close(self) -> None:
        for ctx in self._all:
            _call(self._destroy, ctx)
        self._all, self._idle = [], queue.SimpleQueue()
