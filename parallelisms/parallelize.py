"""The documented order of application, in one place (the recipe and the memory estimator use it).

build on meta -> float8 -> Engram table row-sharding -> activation checkpointing -> compile
-> FSDP2 / HSDP / DDP (then the caller materialises and initialises: init does not depend on the
layout)

float8 comes first, right after the build on meta (as torchtitan's model converters do): it swaps
`nn.Linear` modules for torchao's `Float8Linear`, so it must run before anything wraps or shards
those modules; in particular before tensor parallelism, whose float8-aware styles expect the
`Float8Linear` modules already in place. Compile comes after activation checkpointing and before
FSDP (torchtitan's order), so FSDP's hooks and collectives stay outside the compiled blocks.
"""

from __future__ import annotations

from torch import nn

from engram.config import JobConfig
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import apply_compile
from parallelisms.engram_tables import apply_engram_table_sharding
from parallelisms.float8 import apply_float8
from parallelisms.fsdp import apply_fsdp
from parallelisms.parallel_dims import ParallelDims


def parallelize_model(model: nn.Module, cfg: JobConfig, dims: ParallelDims) -> list[nn.Parameter]:
    """Apply every parallelism in place; returns the row-sharded Engram table parameters."""
    apply_float8(model, cfg.float8, dims.mesh().device_type, compiled=cfg.compile.enable)
    table_params = apply_engram_table_sharding(
        model, dims.mesh("engram"), dedup=cfg.parallelism.engram_table_dedup
    )
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    apply_compile(model, cfg.compile)
    apply_fsdp(model, dims, cfg.parallelism, ignored_params=table_params)
    return table_params
