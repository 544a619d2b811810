"""Streamed table columns: checkpoint NVMe tables without holding a shard in host memory.

An NVMe table's rows and optimizer state live in a row store (a `ColumnRowStore`,
nvme_store.py), not in tensors. Inside `streamed_columns()` (the checkpointer's synchronous
saves, its loads, and a table delta's DCP part) their state dicts hold placeholders instead of
columns read out of the store: a zero-stride view of one element, placed like the table (a
DTensor with the table's mesh, placements and global shape), so DCP plans, reshards and checks
them like any table, while the data moves through `ColumnSource` one row chunk at a time
(engram/checkpoint/dcp_io.py: the save planner splits a placeholder into chunks of at most
`CHUNK_BYTES` and reads each when the writer writes it; the load planner writes each chunk it
reads into the store). Outside the context (asynchronous saves, which copy the state dict to
host memory anyway; exports) the state dicts read whole columns, as before.

A placeholder is known by its one-element storage (identity survives views, detach and
to_local), registered for as long as the context lasts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engram.rowstore.host_worker import HOST_WORKER
from engram.rowstore.interface import ColumnRowStore
from engram.runtime.distributed import placed_like

CHUNK_BYTES = 64 << 20
"""The most bytes of one table column a streamed save reads out of a store at once (one DCP
write item); planner/table_checkpoint.py models a save's host memory with it."""

_REGISTRY: dict[int, tuple[ColumnSource, torch.Tensor]] | None = None


@dataclass(frozen=True)
class ColumnSource:
    """Column `name` of a row store (rows x width fp32 values; width 0: one value per row).
    Reads and writes run on the host worker, behind every queued update and prefetch: the store
    is used from that one thread only."""

    store: ColumnRowStore
    name: str

    @property
    def rows(self) -> int:
        return int(self.store.rows)

    @property
    def width(self) -> int:
        return int(self.store.columns[self.name])

    def read(self, r0: int, n: int) -> torch.Tensor:
        """Rows [r0, r0 + n) of the column, a fresh tensor ([n, width] or [n])."""
        return HOST_WORKER.submit(self.store.read_range, self.name, r0, n).result()

    def write(self, r0: int, values: torch.Tensor, c0: int = 0) -> None:
        """Rows [r0, r0 + len(values)) of the column, values from column `c0` on."""
        HOST_WORKER.submit(self._write, r0, values, c0).result()

    def _write(self, r0: int, values: torch.Tensor, c0: int) -> None:
        n = values.shape[0]
        if c0 or (self.width and values.shape[1] != self.width):  # part of the columns
            whole = self.store.read_range(self.name, r0, n)
            whole[:, c0 : c0 + values.shape[1]] = values
            values = whole
        self.store.load({self.name: values.reshape(n, -1) if self.width else values}, row0=r0)


@contextlib.contextmanager
def streamed_columns() -> Iterator[None]:
    """Row-store tables' state dicts hold placeholders (see the module docstring)."""
    global _REGISTRY
    if _REGISTRY is not None:  # nested: the outer context's placeholders stay valid
        yield
        return
    _REGISTRY = {}
    try:
        yield
    finally:
        _REGISTRY = None


def streaming() -> bool:
    return _REGISTRY is not None


def placeholder(p: torch.Tensor, source: ColumnSource) -> torch.Tensor:
    """A memoryless stand-in for `source`'s column, placed like table `p`."""
    if _REGISTRY is None:
        raise RuntimeError("a streamed column placeholder outside streamed_columns()")
    one = torch.zeros(1, dtype=torch.float32)
    shape = (source.rows, source.width) if source.width else (source.rows,)
    _REGISTRY[one.untyped_storage().data_ptr()] = (source, one)
    return placed_like(p, one.expand(*shape))


def source_of(t: Any) -> ColumnSource | None:
    """The column a placeholder stands for, or None (any other value)."""
    if _REGISTRY is None or not isinstance(t, torch.Tensor):
        return None
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.is_meta or local.numel() == 0 or any(s != 0 for s in local.stride()):
        return None
    entry = _REGISTRY.get(local.untyped_storage().data_ptr())
    return entry[0] if entry is not None else None
