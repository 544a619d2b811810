"""Where the Engram table shards live, stated once: each location (engram.table_location) and
which table optimizers it supports.

Read by the config check (engram/config/schema.py), the optimizer builder
(engram/optim/builder.py) and the table sharding, which pairs each location here with its table
class and its row store (engram/rowstore/) and checks at import that its backends are exactly
these locations. It sits in the config layer because the config checks it when a TOML is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from engram.config.table_optimizers import TABLE_OPTIMIZERS


@dataclass(frozen=True)
class TableLocationSpec:
    name: str
    row_sparse_only: bool
    """Only row-sparse table optimizers (their work per step is O(rows touched)): a dense one
    (adam) reads and writes every row every step, which a store outside device memory cannot
    afford."""
    doc: str

    def supports(self, table_optimizer: str) -> bool:
        return not self.row_sparse_only or TABLE_OPTIMIZERS[table_optimizer].row_sparse

    def optimizers(self) -> tuple[str, ...]:
        """The table optimizers this location supports, in TABLE_OPTIMIZERS order."""
        return tuple(n for n in TABLE_OPTIMIZERS if self.supports(n))


TABLE_LOCATION_SPECS: dict[str, TableLocationSpec] = {
    spec.name: spec
    for spec in (
        TableLocationSpec("device", False, "accelerator memory"),
        TableLocationSpec("host", True, "host memory, gathered and updated on the host worker"),
        TableLocationSpec("nvme", True, "page files on local disk with a host cache in front"),
    )
}

TABLE_LOCATIONS = tuple(TABLE_LOCATION_SPECS)


def table_location_spec(location: str) -> TableLocationSpec:
    if location not in TABLE_LOCATION_SPECS:
        raise ValueError(
            f"engram.table_location must be one of {', '.join(TABLE_LOCATIONS)}, got {location!r}"
        )
    return TABLE_LOCATION_SPECS[location]


def table_location_error(location: str, table_optimizer: str) -> str | None:
    """Why `location` cannot train with `table_optimizer` (a message naming the fix), or None."""
    spec = table_location_spec(location)
    if spec.supports(table_optimizer):
        return None
    return (
        f"engram.table_location = {location} needs a row-sparse table optimizer, got "
        f"optimizer.table_optimizer = {table_optimizer!r} (it touches every row every step): "
        f"set optimizer.table_optimizer to {' or '.join(spec.optimizers())}"
    )
