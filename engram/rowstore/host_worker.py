"""The host worker of Engram tables outside device memory (table_location "host" or "nvme").

One FIFO thread per process runs every host-side job of every host table: the row-sparse
optimizer's update of a host shard and the host-side gathers of rows for later lookups. FIFO
order is the exactness argument: a gather queued after step N's update reads the updated rows,
so host tables train bitwise like device tables (docs/host_tables.md). Torch ops release the GIL,
so the thread overlaps the main thread's forward. Anyone reading a host shard outside the worker
(a checkpoint, a test) calls `wait_host_work()` first.

Which parameters are host-resident travels on the parameter itself, as the attribute named
`_HOST_RESIDENT` (a table's class swap runs no constructor, and the optimizers see only
parameters): `mark_host_resident` is its only writer (the host table, when it is sharded and
when `to_empty` materialises its shard, parallelisms/engram_tables/host.py) and
`is_host_resident` / `table_location_of` its readers (the row-sparse optimizers and their
builder, engram/optim/).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engram.rowstore.interface import ColumnRowStore

# The marker's attribute name on a parameter; read and written only by the functions below.
_HOST_RESIDENT = "_engram_host_resident"


def mark_host_resident(param: torch.Tensor, location: str = "host") -> None:
    """Mark a table parameter whose local shard lives outside device memory, and where
    (engram.table_location: "host")."""
    setattr(param, _HOST_RESIDENT, location)


def is_host_resident(param: torch.Tensor) -> bool:
    """Whether `mark_host_resident` marked this parameter."""
    return bool(getattr(param, _HOST_RESIDENT, False))


def table_location_of(param: torch.Tensor) -> str:
    """The engram.table_location of a table parameter ("device" unless marked)."""
    return getattr(param, _HOST_RESIDENT, None) or "device"


# A table parameter whose rows (and optimizer state) live in a row store, not in its tensors
# (engram.table_location = nvme): the store travels on the parameter like the marker above.
_ROW_STORE = "_engram_row_store"


def attach_row_store(param: torch.Tensor, store: ColumnRowStore) -> None:
    """Give a table parameter the row store that holds its rows and row-sparse optimizer state
    (the NVMe backend, nvme_store.py); the row-sparse optimizers update through it."""
    setattr(param, _ROW_STORE, store)


def row_store_of(param: torch.Tensor) -> ColumnRowStore | None:
    """The row store `attach_row_store` gave this parameter, or None (its tensors hold it)."""
    return getattr(param, _ROW_STORE, None)


class HostWorker:
    """A single-thread FIFO executor that remembers its pending jobs. A failed job fails every
    later one too (a gather after a failed update must not read stale rows); errors surface on
    the job's result and on wait."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1
        self._pending: list[Future] = []
        self._failed: BaseException | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._pool is None or self._pid != os.getpid():  # a forked child starts its own
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-host")
            self._pid, self._pending, self._failed = os.getpid(), [], None
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        future = self._pool.submit(self._run, fn, *args)
        self._pending.append(future)
        return future

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._failed is not None:
            raise RuntimeError("an earlier host-table job failed") from self._failed
        try:
            return fn(*args)
        except BaseException as e:
            self._failed = e
            raise

    def wait(self) -> None:
        """Block until every queued job has run; re-raise the first job error."""
        if self._pid != os.getpid():
            return
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()


HOST_WORKER = HostWorker()


def wait_host_work() -> None:
    """Wait for every queued host update / gather (before reading a host shard directly)."""
    HOST_WORKER.wait()
