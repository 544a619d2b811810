"""The documented order of application, in one place (the recipe and the memory estimator use it).

build on meta -> converters (float8, then LoRA) -> tensor parallel -> context parallel -> Engram
table row-sharding -> activation checkpointing -> compile -> FSDP2 / HSDP / DDP -> training mode (then the caller
materialises and initialises: init does not depend on the layout). Under pipeline parallelism
this runs once per stage.

The converters come first, right after the build on meta (as torchtitan's model converters do):
they swap modules in place, so they must run before anything wraps or shards those modules.
float8 swaps `nn.Linear` for torchao's `Float8Linear`; LoRA then swaps the target linears (float8
ones included) for LoRA subclasses of their own class, which tensor parallelism shards with
their base layer's plan; in lora mode the frozen backbone is cast to the compute dtype there,
before FSDP shards it (at every layout: FSDP2's policy casts at one dp rank too, fsdp.py). The
training mode (`requires_grad`, engram.optim.builder.is_trainable) is set last, once every
parallelism has created its parameters. Context parallelism comes right after TP (as in
torchtitan): it wraps attention around TP's local heads and re-targets the Engram
ShortConv halo that apply_tp installs; it creates no parameters, so the table sharding and FSDP
that follow see the same modules. Compile comes after activation
checkpointing and before FSDP (torchtitan's order), so FSDP's hooks and collectives stay outside
the compiled blocks.

Every dtype cast of a parameter (today only lora mode's frozen backbone, `hold_frozen_in`) happens
before FSDP wraps it, on the meta model: torch_npu's dtype cast has no DTensor sharding strategy,
so a `.to(dtype)` on a sharded parameter fails on Ascend (ms-swift#7870) while it works on CPU.
After `fully_shard` only FSDP's MixedPrecisionPolicy casts (its all-gather copies; at one dp
rank, local cast copies: the compute dtype at every layout, fsdp.py), and
materialisation / init / HF loading write into the local shards in place.
tests/test_parallelisms_cast_order.py fails on any cast of a DTensor here.
"""

from __future__ import annotations

import torch
from torch import nn

from engram.config import JobConfig
from engram.config.table_optimizers import table_optimizer_spec
from engram.optim.builder import apply_training_mode
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import apply_compile
from parallelisms.context_parallel import apply_context_parallel
from parallelisms.engram_tables import NvmeSettings, apply_engram_table_sharding
from parallelisms.float8 import apply_float8
from parallelisms.fsdp import DTYPES, apply_fsdp
from parallelisms.lora import apply_lora, hold_frozen_in
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import apply_tp


def engram_halo(cfg: JobConfig) -> int:
    """Positions before a sequence chunk that the Engram ShortConv reads (0 without Engram)."""
    e = cfg.engram
    if not (e.enabled and e.layer_ids):
        return 0
    return (e.kernel_size - 1) * e.max_ngram


def frozen_dtype(cfg: JobConfig) -> torch.dtype:
    """dtype of the frozen backbone in lora mode: the compute dtype (with lora.frozen_dtype =
    "compute"; at every layout, since FSDP2's policy casts at one dp rank too), else float32."""
    if cfg.lora.frozen_dtype == "compute":
        return DTYPES[cfg.parallelism.mixed_precision_param]
    return torch.float32


def shard_engram_tables(
    model: nn.Module, cfg: JobConfig, dims: ParallelDims, grad_scale: float = 1.0
) -> list[nn.Parameter]:
    """Row-shard the Engram tables as configured (also used by recipes/train_deepspeed.py).

    Tables over every rank of the stage (dp x cp x tp). Every rank's loss is its share of the
    step's token mean (its token sum over the step's one count, engram/train/loss.py), and each
    token is looked up once: by its TP rank (a loss replicated over TP, each rank looking up its
    own tokens), by its cp rank, by its dp rank. So the owners' sum of the lookups' gradients is
    the gradient of the step's loss: `grad_scale` 1, the divisor applied exactly once, by the
    loss. An engine that scales the loss to undo its own dp mean passes the inverse factor
    (DeepSpeed: 1 / dp, runner/engine_step.py)."""
    return apply_engram_table_sharding(
        model,
        dims.mesh("engram"),
        grad_scale=grad_scale,
        dedup=cfg.parallelism.engram_table_dedup,
        row_sparse=table_optimizer_spec(cfg.optimizer.table_optimizer).row_sparse,
        wire_dtype=DTYPES.get(cfg.parallelism.engram_a2a_dtype),
        location=cfg.engram.table_location,
        nvme=NvmeSettings(
            tuple(cfg.engram.nvme_dirs),
            int(cfg.engram.nvme_host_cache_gib * 2**30),
            cfg.optimizer.table_optimizer,
        ),
    )


def convert_model(model: nn.Module, cfg: JobConfig, dims: ParallelDims) -> None:
    """The converter slot, on the meta model before any parallelism: float8, then LoRA (lora
    mode: adapters, and the frozen backbone held in `frozen_dtype`). Also the DeepSpeed
    variant's (runner/deepspeed_engine.py place_for_engine), so LoRA is one code path.
    Not named apply_*: it is no step of its own for planner/registry.py, only these two."""
    apply_float8(model, cfg.float8, dims.mesh().device_type, compiled=cfg.compile.enable)
    if cfg.training.mode == "lora":
        apply_lora(model, cfg.lora)
        hold_frozen_in(model, frozen_dtype(cfg))


def parallelize_model(model: nn.Module, cfg: JobConfig, dims: ParallelDims) -> list[nn.Parameter]:
    """Apply every parallelism in place; returns the row-sharded Engram table parameters."""
    dims.check_model(model.args, cfg.training.seq_len, engram_halo(cfg))
    convert_model(model, cfg, dims)
    if dims.tp_enabled:
        apply_tp(
            model,
            dims.mesh("tp"),
            sequence_parallel=cfg.parallelism.tp_sequence_parallel,
            loss_parallel=cfg.parallelism.tp_loss_parallel,
        )
        if cfg.parallelism.tp_sequence_parallel and model.tok_embeddings is None:
            model.set_input_seq_shards(dims.tp)  # a later pipeline stage gets T / tp positions
    # After TP: attention's heads are TP's local ones, and the ShortConv halo that apply_tp set
    # over tp is re-targeted to the cp x tp pieces.
    apply_context_parallel(model, dims)
    table_params = shard_engram_tables(model, cfg, dims)
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    apply_compile(model, cfg.compile)
    apply_fsdp(model, dims, cfg.parallelism, ignored_params=table_params)
    # Last: torch's SequenceParallel style re-creates the norms' parameters trainable.
    apply_training_mode(model, cfg.training.mode)
    return table_params
