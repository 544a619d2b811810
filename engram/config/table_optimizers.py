"""The Engram table optimizers, stated once: name -> class, whether the tables take row-sparse
gradients, and the optimizer state per table row.

Read by the config check (engram/config/), the optimizer builder (engram/optim/builder.py), the table
lookup (parallelisms/parallelize.py passes `row_sparse` to apply_engram_table_sharding), the
pipeline's split-backward refusal (parallelisms/pipeline.py), the host-memory check of
host-resident tables (parallelisms/engram_tables/host_memory.py) and the memory planner
(planner/tables.py, planner/measure.py), the last two through `table_memory_bytes`. Importing it
imports no torch, and the optimizer room itself imports the class it names when it builds one
(engram/optim/builder.py): configuration sits below optim.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TableOptimizerSpec:
    name: str
    class_path: str
    """"module:Class" of the optimizer."""
    row_sparse: bool
    """The tables' lookups leave (unique rows, fp32 row gradients) on the parameter and no dense
    table gradient (engram/models/table_grad.py); the optimizer reads only the touched rows."""
    fp32_states_per_param: int
    """fp32 optimizer state values per table parameter (Adam's two moments)."""
    fp32_states_per_row: int
    """fp32 optimizer state values per table row (row-wise Adagrad's accumulator)."""
    takes_betas: bool
    """The constructor takes optimizer.betas."""

    def state_bytes_per_row(self, dim: int) -> int:
        """Persistent optimizer-state bytes of one table row of width `dim`."""
        return 4 * (self.fp32_states_per_param * dim + self.fp32_states_per_row)


TABLE_OPTIMIZERS: dict[str, TableOptimizerSpec] = {
    spec.name: spec
    for spec in (
        TableOptimizerSpec("adam", "torch.optim:AdamW", False, 2, 0, True),
        TableOptimizerSpec("lazy_adam", "engram.optim.lazy_adam:LazyAdam", True, 2, 0, True),
        TableOptimizerSpec(
            "rowwise_adagrad", "engram.optim.lazy_adam:RowwiseAdagrad", True, 0, 1, False
        ),
    )
}


def table_optimizer_spec(name: str) -> TableOptimizerSpec:
    if name not in TABLE_OPTIMIZERS:
        raise ValueError(
            f"unknown table optimizer {name!r}: use one of {', '.join(TABLE_OPTIMIZERS)}"
        )
    return TABLE_OPTIMIZERS[name]


def table_memory_bytes(table_optimizer: str, rows: int, dim: int, param_bytes: int = 4) -> dict:
    """Persistent bytes of one [rows, dim] table (or local shard) per table optimizer choice:
    weight, gradient (dense: table-sized; row-sparse: none between steps, only the touched rows'
    fp32 gradient during a step) and fp32 optimizer state."""
    spec = table_optimizer_spec(table_optimizer)
    params = rows * dim
    return {
        "weight": params * param_bytes,
        "grad": 0 if spec.row_sparse else params * param_bytes,
        "optimizer": rows * spec.state_bytes_per_row(dim),
    }
