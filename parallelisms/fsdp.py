"""FSDP2 / HSDP / DDP through one mechanism: `fully_shard` per decoder layer, then the root.

    dp_shard > 1, dp_replicate = 1   FSDP (ZeRO-3 with reshard "always", ZeRO-2-like with "never")
    dp_shard > 1, dp_replicate > 1   HSDP: replicate across the first mesh dim, shard within the second
    dp_shard = 1, dp_replicate > 1   DDP: full replicas, gradients all-reduced (HSDP with shard size 1)

"dp_shard" here is the flattened dp_shard x cp mesh (context parallel ranks shard too).

The Engram tables are passed as `ignored_params`: FSDP never all-gathers, shards or reduces them;
they are row-sharded over the "engram" axis by parallelisms/engram_tables/ instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from engram.config import Parallelism
from parallelisms.parallel_dims import ParallelDims

# parallelism.mixed_precision_* names -> dtypes (the memory estimator reads the byte sizes here).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def reshard_after_forward(dims: ParallelDims, cfg: Parallelism) -> tuple[bool, bool]:
    """(decoder layers, root) reshard after forward? DDP keeps full parameters anyway; resharding
    only matters when parameters are sharded. The root is needed again at the start of backward,
    so only "always" reshards it."""
    # Under PP, "default" keeps parameters unsharded between forward and backward: a stage runs
    # many micro-batches, and resharding would all-gather them again for each one.
    layer = dims.fsdp_enabled and (
        cfg.fsdp_reshard_after_forward == "always"
        or (cfg.fsdp_reshard_after_forward == "default" and not dims.pp_enabled)
    )
    root = dims.fsdp_enabled and cfg.fsdp_reshard_after_forward == "always"
    return layer, root


def apply_fsdp(
    model: nn.Module, dims: ParallelDims, cfg: Parallelism, ignored_params: list[nn.Parameter]
) -> None:
    """Wrap `model.layers[*]` and the root with fully_shard (no-op when there is one dp rank)."""
    if dims.dp_replicate * dims.fsdp_size == 1:
        return
    # cp ranks shard parameters like dp_shard ranks (torchtitan's dp_shard_cp): they hold other
    # tokens of the same samples, so their gradients are averaged like data-parallel ones.
    mesh = dims.mesh("fsdp")  # 2-D with dp_replicate > 1: HSDP, or DDP if dp_shard x cp == 1
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


def defer_grad_sync(dims: ParallelDims) -> bool:
    """Whether gradient accumulation may skip the reduction on non-last micro-batches.

    Only for DDP, whose gradients are full-size anyway. With sharded parameters, skipping the
    reduce-scatter makes FSDP2 keep every unit's full unsharded fp32 gradient until the last
    micro-batch (4 B x all parameters per rank: 122 GiB for the 32B shape), so FSDP / HSDP
    reduce-scatter every micro-batch instead (as torchtitan does).
    """
    return dims.ddp_enabled
