"""FSDP2 / HSDP / DDP through one mechanism: `fully_shard` per decoder layer, then the root.

    dp_shard > 1, dp_replicate = 1   FSDP (ZeRO-3 with reshard "always", ZeRO-2-like with "never")
    dp_shard > 1, dp_replicate > 1   HSDP: replicate across the first mesh dim, shard within the second
    dp_shard = 1, dp_replicate > 1   DDP: full replicas, gradients all-reduced (HSDP with shard size 1)

"dp_shard" here is the flattened dp_shard x cp mesh (context parallel ranks shard too).

FSDP2's MixedPrecisionPolicy is also the one mechanism that makes `mixed_precision_param` the
compute dtype, at every layout: with one dp rank (1 device, TP only, PP only, TP x PP) and a
compute dtype other than float32, `fully_shard` runs on the size-1 "fsdp" mesh, where its
"all-gather" is a local cast copy of the fp32 master weights and its "reduce-scatter" a local
cast of the gradient into `mixed_precision_reduce` and back to fp32. Under TP the parameters
become 2-D (fsdp, tp) DTensors, as with FSDP x TP; under PP each stage is its own root. An
all-fp32 run at one dp rank is left unwrapped (nothing to cast, so it runs as before) unless
cpu_offload asks for FSDP2's CPUOffloadPolicy.

The Engram tables are passed as `ignored_params`: FSDP never all-gathers, shards or reduces them;
they are row-sharded over the "engram" axis by parallelisms/engram_tables/ instead.

Gradients are SUMMED over the dp (x cp) ranks, not averaged (FSDP2's default): every rank's loss
is already its share of the step's token mean, its token sum over the step's one count of target
tokens (engram/train/loss.py). `set_gradient_divide_factor(1.0)` with
`set_force_sum_reduction_for_comms(True)` makes every reduce-scatter and all-reduce a plain SUM
(no PreMulSum op, which gloo and HCCL lack and which NCCL mishandles in bf16).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from engram.config import Parallelism
from parallelisms.parallel_dims import ParallelDims

# parallelism.mixed_precision_* names -> dtypes (the memory estimator reads the byte sizes here).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

logger = logging.getLogger("engram.precision")  # shown with the recipe's log (engram.train.metrics)


def fsdp_wraps(dims: ParallelDims, cfg: Parallelism) -> bool:
    """Whether apply_fsdp wraps the model: with more than one dp rank, and at one dp rank when
    there is something only FSDP2 does: a compute dtype other than float32 (its
    MixedPrecisionPolicy) or cpu_offload (its CPUOffloadPolicy). The memory planner reads it."""
    one_rank = dims.dp_replicate * dims.fsdp_size == 1
    return not one_rank or cfg.mixed_precision_param != "float32" or cfg.cpu_offload


def precision_summary(dims: ParallelDims, cfg: Parallelism) -> str:
    """One line: the compute dtype in force and the mechanism that applies it."""
    master = "trainable master weights, gradients and optimizer state float32"
    if not fsdp_wraps(dims, cfg):
        return f"precision: compute float32 (one dp rank, nothing cast), {master}"
    ranks = dims.dp_replicate * dims.fsdp_size
    copies = "cast copies" if cfg.mixed_precision_param != "float32" else "copies, for cpu_offload"
    where = f"a 1-rank mesh: local {copies}" if ranks == 1 else f"{ranks} dp ranks"
    return (
        f"precision: compute {cfg.mixed_precision_param}, gradients reduced in "
        f"{cfg.mixed_precision_reduce} (FSDP2 MixedPrecisionPolicy on {where}), {master}"
    )


@functools.cache
def _log_once(line: str) -> None:
    # Once per process, not once per pipeline stage (apply_fsdp runs per stage).
    logger.info(line)


def reshard_after_forward(dims: ParallelDims, cfg: Parallelism) -> tuple[bool, bool]:
    """(decoder layers, root) reshard after forward? The root is needed again at the start of
    backward, so only "always" reshards it. With shard size 1 (DDP, one dp rank) the unsharded
    parameters are local copies (casts to the compute dtype), so "default" keeps them from
    forward to backward rather than copying twice; "always" frees them (memory for a second
    copy in backward)."""
    # Under PP, "default" keeps parameters unsharded between forward and backward: a stage runs
    # many micro-batches, and resharding would all-gather them again for each one.
    always = cfg.fsdp_reshard_after_forward == "always"
    default = cfg.fsdp_reshard_after_forward == "default"
    layer = always or (default and dims.fsdp_enabled and not dims.pp_enabled)
    return layer, always


def apply_fsdp(
    model: nn.Module, dims: ParallelDims, cfg: Parallelism, ignored_params: list[nn.Parameter]
) -> None:
    """Wrap `model.layers[*]` and the root with fully_shard (a no-op when `fsdp_wraps` says so:
    one dp rank, all float32, no offload)."""
    _log_once(precision_summary(dims, cfg))
    if not fsdp_wraps(dims, cfg):
        return
    # cp ranks shard parameters like dp_shard ranks (torchtitan's dp_shard_cp): they hold other
    # tokens of the same samples, so their gradients are averaged like data-parallel ones.
    # 2-D with dp_replicate > 1: HSDP, or DDP if dp_shard x cp == 1; size 1 at one dp rank
    mesh = dims.mesh("fsdp")
    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.mixed_precision_param],
        reduce_dtype=DTYPES[cfg.mixed_precision_reduce],
    )
    offload = OffloadPolicy()
    if cfg.cpu_offload:
        # Pinned host memory needs an accelerator; on a CPU-only run the same code path runs unpinned.
        offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    layer_reshard, root_reshard = reshard_after_forward(dims, cfg)
    common = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    for layer in model.layers.values():
        ignored = {p for p in layer.parameters() if any(p is q for q in ignored_params)}
        fully_shard(
            layer, reshard_after_forward=layer_reshard, ignored_params=ignored or None, **common
        )
    fully_shard(
        model,
        reshard_after_forward=root_reshard,
        ignored_params=set(ignored_params) or None,
        **common,
    )
    for module in model.modules():  # the shares of the step's token mean add up (see above)
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def defer_grad_sync(dims: ParallelDims) -> bool:
    """Whether gradient accumulation may skip the reduction on non-last micro-batches.

    Only for DDP, whose gradients are full-size anyway. With sharded parameters, skipping the
    reduce-scatter makes FSDP2 keep every unit's full unsharded fp32 gradient until the last
    micro-batch (4 B x all parameters per rank: 122 GiB for the 32B shape), so FSDP / HSDP
    reduce-scatter every micro-batch instead (as torchtitan does).
    """
    return dims.ddp_enabled
