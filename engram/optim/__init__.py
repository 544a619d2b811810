"""Optimisers: the parameter groups of a run (backbone, Engram dense, Engram tables, LoRA) and
the row-sparse table optimisers.

- `builder.py`: `build_optimizers` / param groups (table lr multiplier, weight decay), global
  gradient-norm clipping over every parallel layout, the lr schedule, `is_trainable`.
- `lazy_adam.py`: row-sparse table optimisers (`lazy_adam` = torch SparseAdam's update,
  `rowwise_adagrad`), reading the row gradients of engram/models/table_grad.py.
- `touched_rows.py`: the rows updated since the last save (incremental table checkpoints).
- `update_stats.py`: a log step's table update, rows touched and its size (telemetry).

A new table optimiser: its class here, its line in engram/config/table_optimizers.py.
"""
