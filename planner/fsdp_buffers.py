"""Transient FSDP buffers (all-gather, reduce-scatter, gradient accumulation) from the exact unit
shapes, padded as FSDP2 pads them."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engram.config import JobConfig
from parallelisms.fsdp import fsdp_wraps, reshard_after_forward
from parallelisms.parallel_dims import ParallelDims
from planner.results import FsdpBuffers, dtype_bytes


def _fsdp_units(model: nn.Module, table_params: list[nn.Parameter]) -> list[tuple[str, list]]:
    """(name, parameters FSDP manages in that unit), inner units first, the root last."""
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    out, claimed = [], {id(p) for p in table_params}  # ids: the model holds the parameters
    for name, module in sorted(units, key=lambda u: -len(u[0])):  # deepest name first
        own = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        out.append((name or "<root>", own))
    return out


def _fsdp_unsharded_shape(p: torch.Tensor) -> tuple[int, ...]:
    """What FSDP all-gathers of `p`: its TP-local shape (a TP-sharded dim divided by tp, as
    DTensor splits it), or the global shape without TP."""
    shape = list(p.shape)
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        for name, placement in zip(mesh.mesh_dim_names or (), p.placements, strict=True):
            if name == "tp" and placement.is_shard():
                d = placement.dim
                shape[d] = math.ceil(shape[d] / mesh.size(mesh.mesh_dim_names.index("tp")))
    return tuple(shape)


def _padded_numel(p: torch.Tensor, shard_size: int) -> int:
    """Unsharded numel of FSDP2's all-gather output: dim 0 (TP-local) padded to a multiple of the
    shard size."""
    shape = _fsdp_unsharded_shape(p)
    rows = math.ceil(shape[0] / shard_size) * shard_size if shape else 1
    return rows * math.prod(shape[1:])


def fsdp_buffers(
    cfg: JobConfig,
    dims: ParallelDims,
    parts: list[nn.Module],
    table_params: list[nn.Parameter],
    no_sync_accumulation: bool,
) -> FsdpBuffers:
    """FSDP buffers of this rank's model parts (one part, or its pipeline stages: each stage is
    its own FSDP root)."""
    # As apply_fsdp decides: at one dp rank too when it casts (its copies are then local casts).
    fsdp_on = fsdp_wraps(dims, cfg.parallelism)
    compute = cfg.parallelism.mixed_precision_param if fsdp_on else "float32"
    reduce = cfg.parallelism.mixed_precision_reduce if fsdp_on else "float32"
    a, r = dtype_bytes(compute), dtype_bytes(reduce)
    units = [u for part in parts for u in _fsdp_units(part, table_params)] if fsdp_on else []
    s = dims.fsdp_size  # the shard group: dp_shard x cp

    def unsharded(params: list, trainable_only: bool = False) -> int:
        return sum(_padded_numel(p, s) for p in params if p.requires_grad or not trainable_only)

    layers = [(n, ps) for n, ps in units if n != "<root>"]
    roots = [p for n, ps in units if n == "<root>" for p in ps]
    big_name, big = max(layers, key=lambda u: unsharded(u[1]), default=("no FSDP", []))
    # Layers that do not reshard after forward stay gathered from their forward to their
    # backward, so all of them coexist at the start of backward (under PP: all of the rank's
    # stages, kept unsharded across the micro-batches of a step).
    # torch's pipeline stage also keeps them unsharded after every backward but the last
    # (set_reshard_after_backward(False)), whatever fsdp_reshard_after_forward says.
    layer_reshard = reshard_after_forward(dims, cfg.parallelism)[0] and not dims.pp_enabled
    if layer_reshard:
        gathered = 2 * unsharded(big)  # current layer + the prefetched next one
    else:
        gathered = sum(unsharded(ps) for _, ps in layers)
    return FsdpBuffers(
        compute_dtype=compute,
        reduce_dtype=reduce,
        largest_layer=big_name,
        layer_unsharded_params=unsharded(big),
        layers_reshard_after_forward=layer_reshard,
        layer_gather_bytes=a * gathered,
        root_unsharded_params=unsharded(roots),
        root_gather_bytes=a * unsharded(roots),
        layer_reduce_bytes=(a + 2 * r) * unsharded(big, trainable_only=True),
        root_grad_bytes=a * unsharded(roots, trainable_only=True),
        root_reduce_bytes=r * unsharded(roots, trainable_only=True),
        no_sync_accum_bytes=(
            r * sum(unsharded(ps, trainable_only=True) for _, ps in units)
            if no_sync_accumulation
            else 0
        ),
    )
