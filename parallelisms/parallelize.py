"""The documented order of application, in one place (the recipe and the memory estimator use it).

build on meta -> Engram table row-sharding -> activation checkpointing -> FSDP2 / HSDP / DDP
(then the caller materialises and initialises: init does not depend on the layout)
"""

from __future__ import annotations

from torch import nn

from engram.config import JobConfig
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.engram_tables import apply_engram_table_sharding
from parallelisms.fsdp import apply_fsdp
from parallelisms.parallel_dims import ParallelDims


def parallelize_model(model: nn.Module, cfg: JobConfig, dims: ParallelDims) -> list[nn.Parameter]:
    """Apply every parallelism in place; returns the row-sharded Engram table parameters."""
    table_params = apply_engram_table_sharding(
        model, dims.mesh("engram"), dedup=cfg.parallelism.engram_table_dedup
    )
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    apply_fsdp(model, dims, cfg.parallelism, ignored_params=table_params)
    return table_params
