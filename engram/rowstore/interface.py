"""The row-store interface under the Engram table shards; its backends are memory.py (device,
host) and nvme_store.py (NVMe), by engram.table_location (engram/config/table_locations.py
states which optimizers each supports).

A store holds the rows of one rank's table shard. A lookup and an optimizer update see a table
only through it:

    read_rows(idx)          the rows `idx` (local row numbers), now
    write_rows(idx, rows)   overwrite them (unique idx)
    prefetch(idx, device)   a Future of the rows `idx` on `device`, queued behind every earlier
                            write (so it reads the rows as updated: the exactness argument);
                            pinned unless pin=False
    page_in(idx)            start bringing rows `idx` of a later step resident (queued behind
                            every earlier write, returns at once; a hint: values never depend on
                            it); nothing for memory stores, whose rows are all resident
    pin(idx) / release(idx) keep rows resident between a prefetch and their last use
    release_all()           end every pin (the optimizer, after the step's update)
    snapshot()              the whole shard, after every queued write (checkpoints)

A `ColumnRowStore` also keeps the table's row-sparse optimizer state beside each row, as named
columns (the weight first): a table whose rows live there holds none in its tensors, and the
store travels on its weight parameter (host_worker.py `attach_row_store` / `row_store_of`) to
whoever reads or writes rows: the row-sparse optimizers (engram/optim/lazy_adam.py), table
deltas (engram/checkpoint/table_delta.py), streamed checkpoints (streamed_columns.py), the init
(engram/models/init.py) and the Hugging Face load (engram/hf/load.py).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

__all__ = ["ColumnRowStore", "RowStore"]


class RowStore:
    """The rows of one table shard (see the module docstring). Subclasses state where they live."""

    location: str

    def read_rows(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write_rows(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def prefetch(self, idx: torch.Tensor, device: torch.device, pin: bool = True) -> Future:
        raise NotImplementedError

    def page_in(self, idx: torch.Tensor) -> None:
        """Start bringing rows `idx` resident ahead of their step (memory stores: nothing)."""

    def pin(self, idx: torch.Tensor) -> None:
        """Keep rows `idx` resident until `release` (memory stores hold every row: nothing)."""

    def release(self, idx: torch.Tensor) -> None:
        """End a `pin`."""

    def release_all(self) -> None:
        """End every pin."""

    def snapshot(self) -> torch.Tensor:
        raise NotImplementedError


class ColumnRowStore(RowStore):
    """A row store whose records hold named columns per row (see the module docstring):
    `columns` maps each name to its width in fp32 values (0: one value per row, read as shape
    [n]); the first is the weight."""

    rows: int
    columns: dict[str, int]
    rows_per_page: int = 1
    """Rows stored together as one unit: a `load` of every column of whole units (row offsets
    and counts multiples of it) writes them without reading them first."""

    def read_columns(
        self, idx: torch.Tensor, names: list[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """{column: its rows `idx`} (every column unless `names`)."""
        raise NotImplementedError

    def write_columns(self, idx: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Overwrite columns of rows `idx` (unique) with `values` {column: [n, width] or [n]}."""
        raise NotImplementedError

    def read_range(self, name: str, r0: int, n: int) -> torch.Tensor:
        """Column `name` of rows [r0, r0 + n)."""
        raise NotImplementedError

    def load(
        self, values: dict[str, torch.Tensor], chunk_rows: int | None = None, row0: int = 0
    ) -> None:
        """Write columns {name: [n, width] or [n]} into rows [row0, row0 + n)."""
        raise NotImplementedError

    def snapshot(self, name: str | None = None) -> torch.Tensor:
        """Column `name` (default the weight) of every row."""
        raise NotImplementedError
