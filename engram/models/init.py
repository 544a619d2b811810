"""Layout-independent deterministic weight initialisation.

The full (global) tensor of a parameter is defined as a sequence of fixed row chunks; chunk `c`
is drawn from a CPU generator seeded by a stable hash of (seed, key, c). The chunk size depends
only on the global shape. A shard (FSDP2 Shard(0), TP Shard(0)/Shard(1), FSDP2 over TP
(_StridedShard, Shard), an uneven row-sharded Engram table, Replicate) generates only the chunks that overlap its global row range and slices
out its block. So the assembled weights are bit-identical for every parallel layout, and equal
to what one process computes for the unsharded tensor.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import (
    _get_shard_size_and_offsets,
    compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import _StridedShard

from engram.rowstore.host_worker import row_store_of

# Elements per generated chunk (~4 MiB of fp32): big enough to be fast, small enough that a
# shard never generates much more than it keeps.
CHUNK_NUMEL = 2**20


def chunk_rows(global_shape: tuple[int, ...]) -> int:
    """Rows per chunk; depends only on the global shape."""
    row_numel = math.prod(global_shape[1:]) if len(global_shape) > 1 else 1
    return max(1, CHUNK_NUMEL // max(1, row_numel))


def chunk_seed(seed: int, key: str, chunk: int) -> int:
    """A stable 63-bit seed for one chunk (independent of Python's per-process hash salt)."""
    digest = hashlib.blake2b(f"{seed}\x00{key}\x00{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def local_view(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, local shape, global offset) for a plain tensor or a DTensor.

    The local shard must be one contiguous block of the global tensor. That holds for Shard /
    Replicate and for FSDP2 over TP (`_StridedShard` on the dp dim of a TP-sharded dim: FSDP
    splits this rank's contiguous TP chunk); any other strided layout is an error here rather
    than wrong weights.
    """
    if isinstance(param, DTensor):
        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        if tuple(local.shape) != tuple(shape):
            raise RuntimeError(
                f"local shard shape {tuple(local.shape)} != expected {tuple(shape)} for a DTensor "
                f"of global shape {tuple(param.shape)} with placements {param.placements}"
            )
        if any(isinstance(p, _StridedShard) for p in param.placements):
            _check_contiguous(param, tuple(shape))
        return local, tuple(shape), tuple(offset)
    return param, tuple(param.shape), (0,) * param.dim()


def _check_contiguous(param: DTensor, local_shape: tuple[int, ...]) -> None:
    """Raise unless this rank's indices along every sharded dim are consecutive."""
    mesh, coord = param.device_mesh, param.device_mesh.get_coordinate()
    assert coord is not None
    offsets: dict[int, torch.Tensor] = {}
    sizes = list(param.shape)
    for mesh_dim, placement in enumerate(param.placements):
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        d = placement.dim
        sizes[d], offsets[d] = _get_shard_size_and_offsets(
            sizes[d], mesh.size(mesh_dim), coord[mesh_dim], placement, offsets.get(d),
            param.shape[d], False,
        )  # fmt: skip
    for d, index in offsets.items():
        n = local_shape[d]
        if n and not torch.equal(index[:n], torch.arange(int(index[0]), int(index[0]) + n)):
            raise NotImplementedError(
                f"placements {param.placements} give rank {coord} a non-contiguous slice of dim "
                f"{d}; layout-independent init and HF loading need one contiguous block"
            )


@torch.no_grad()
def init_normal_(param: torch.Tensor, std: float, seed: int, key: str, mean: float = 0.0) -> None:
    """Fill `param` (or its local shard) with N(mean, std^2) values of the layout-independent
    global tensor identified by (seed, key)."""

    def draw(n: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(n, generator=gen, dtype=torch.float32)

    _fill_chunks(param, seed, key, draw, std, mean)


@torch.no_grad()
def init_uniform_(param: torch.Tensor, bound: float, seed: int, key: str) -> None:
    """Fill `param` (or its local shard) with U(-bound, bound) values of the layout-independent
    global tensor identified by (seed, key)."""

    def draw(n: int, gen: torch.Generator) -> torch.Tensor:
        return torch.rand(n, generator=gen, dtype=torch.float32).mul_(2.0).sub_(1.0)

    _fill_chunks(param, seed, key, draw, bound, 0.0)


def _fill_chunks(
    param: torch.Tensor,
    seed: int,
    key: str,
    draw: Callable[[int, torch.Generator], torch.Tensor],
    scale: float,
    shift: float,
) -> None:
    """The chunks of the global tensor (seed, key) that overlap this shard: `draw(numel, gen)`
    per chunk, times `scale` plus `shift`, sliced to the local block. A table whose rows live in
    a row store (NVMe) gets each chunk written there: the shard is never whole in memory."""
    local, shape, offset = local_view(param)
    store = row_store_of(param)
    if local.numel() == 0 or local.is_meta:  # nothing held here (or not materialised yet)
        return
    global_shape = tuple(param.shape)
    if len(global_shape) == 0:  # a scalar is one row of one element
        global_shape, shape, offset = (1,), (1,), (0,)
        local = local.view(1)
    rows_per_chunk = chunk_rows(global_shape)
    row_shape = global_shape[1:]
    row_numel = math.prod(row_shape)
    r0, r1 = offset[0], offset[0] + shape[0]
    col_slices = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))
    for c in range(r0 // rows_per_chunk, (r1 - 1) // rows_per_chunk + 1):
        c0 = c * rows_per_chunk
        c1 = min(c0 + rows_per_chunk, global_shape[0])
        gen = torch.Generator(device="cpu").manual_seed(chunk_seed(seed, key, c))
        block = draw((c1 - c0) * row_numel, gen).view(c1 - c0, *row_shape)
        lo, hi = max(r0, c0), min(r1, c1)
        piece = block[(slice(lo - c0, hi - c0), *col_slices)]
        if scale != 1.0:
            piece = piece * scale
        if shift != 0.0:
            piece = piece + shift
        if store is not None:
            store.load({"weight": piece.contiguous()}, row0=lo - r0)
        else:
            local[lo - r0 : hi - r0].copy_(piece)


@torch.no_grad()
def init_constant_(param: torch.Tensor, value: float) -> None:
    """Fill `param` (or its local shard) with a constant."""
    local = param.to_local() if isinstance(param, DTensor) else param
    local.fill_(value)
