"""The rows a row-sparse table optimizer updated since the last checkpoint save, per table.

An incremental table checkpoint (engram/checkpoint/table_delta.py) writes only these rows: the
optimizer is the only writer of a table's rows and their state after the start (a resume or an
initialisation is followed by a full save or clears the record), and it updates every row of
its row gradient (the moments of a zero-gradient row move too), so these are exactly the rows
that differ from the previous save."""

from __future__ import annotations

import torch

_COMPACT_AFTER = 16  # merge the recorded index tensors every this many steps: O(touched) memory


class TouchedRows:
    """Local row ids per table parameter, recorded by RowSparseOptimizer.step (main thread)."""

    def __init__(self) -> None:
        self._rows: dict[int, list[torch.Tensor]] = {}

    def add(self, param: torch.Tensor, rows: torch.Tensor) -> None:
        parts = self._rows.setdefault(id(param), [])
        parts.append(rows.detach().to("cpu", torch.int64))
        if len(parts) > _COMPACT_AFTER:
            self._rows[id(param)] = [torch.unique(torch.cat(parts))]

    def take(self, param: torch.Tensor) -> torch.Tensor:
        """The sorted unique local rows touched since the last take / clear; forgets them."""
        parts = self._rows.pop(id(param), [])
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        return torch.unique(torch.cat(parts))

    def clear(self) -> None:
        self._rows.clear()
