"""The documented order of application, in one place (the recipe and the memory estimator use it).

build on meta -> float8 -> tensor parallel -> Engram table row-sharding -> activation
checkpointing -> compile -> FSDP2 / HSDP / DDP (then the caller materialises and initialises: init
does not depend on the layout). Under pipeline parallelism this runs once per stage.

float8 comes first, right after the build on meta (as torchtitan's model converters do): it swaps
`nn.Linear` modules for torchao's `Float8Linear`, so it must run before anything wraps or shards
those modules; in particular before tensor parallelism, whose float8-aware styles expect the
`Float8Linear` modules already in place. Compile comes after activation checkpointing and before
FSDP (torchtitan's order), so FSDP's hooks and collectives stay outside the compiled blocks.
"""

from __future__ import annotations

from torch import nn

from engram.config import JobConfig
from engram.table_optimizers import table_optimizer_spec
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import apply_compile
from parallelisms.engram_tables import apply_engram_table_sharding
from parallelisms.float8 import apply_float8
from parallelisms.fsdp import DTYPES, apply_fsdp
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import apply_tp


def engram_halo(cfg: JobConfig) -> int:
    """Positions before a sequence chunk that the Engram ShortConv reads (0 without Engram)."""
    e = cfg.engram
    if not (e.enabled and e.layer_ids):
        return 0
    return (e.kernel_size - 1) * e.max_ngram


def shard_engram_tables(model: nn.Module, cfg: JobConfig, dims: ParallelDims) -> list[nn.Parameter]:
    """Row-shard the Engram tables as configured (also used by recipes/train_deepspeed.py).

    Tables over every rank of the stage (dp x tp). Each TP rank looks up only its own tokens, so
    the owners receive the sum over the dp replicas: 1 / dp gives the data-parallel mean."""
    return apply_engram_table_sharding(
        model,
        dims.mesh("engram"),
        grad_scale=1.0 / dims.dp_size,
        dedup=cfg.parallelism.engram_table_dedup,
        row_sparse=table_optimizer_spec(cfg.optimizer.table_optimizer).row_sparse,
        wire_dtype=DTYPES.get(cfg.parallelism.engram_a2a_dtype),
    )


def parallelize_model(model: nn.Module, cfg: JobConfig, dims: ParallelDims) -> list[nn.Parameter]:
    """Apply every parallelism in place; returns the row-sharded Engram table parameters."""
    dims.check_model(model.args, cfg.training.seq_len, engram_halo(cfg))
    apply_float8(model, cfg.float8, dims.mesh().device_type, compiled=cfg.compile.enable)
    if dims.tp_enabled:
        apply_tp(
            model,
            dims.mesh("tp"),
            sequence_parallel=cfg.parallelism.tp_sequence_parallel,
            loss_parallel=cfg.parallelism.tp_loss_parallel,
        )
        if cfg.parallelism.tp_sequence_parallel and model.tok_embeddings is None:
            model.input_seq_shards = dims.tp  # a later pipeline stage gets T / tp positions
    table_params = shard_engram_tables(model, cfg, dims)
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    apply_compile(model, cfg.compile)
    apply_fsdp(model, dims, cfg.parallelism, ignored_params=table_params)
    return table_params
