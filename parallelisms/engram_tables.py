"""Row-sharded Engram tables with an all-to-all lookup.

Each table is a DTensor with placement Shard(0) on a 1-D "engram" mesh: rank r owns rows
[r * c, min((r + 1) * c, R)) with c = ceil(R / W) (the torch.chunk split, so DCP saves and
reshards it, and the last ranks may hold fewer rows or none). A lookup sends each id to the rank
that owns its row and brings the row back; the backward sends the row gradients to the owners,
which add them into a dense gradient of their shard, or, for a table sharded with
`row_sparse=True` (its optimizer is row-sparse: lazy_adam / rowwise_adagrad), keep (unique local rows, fp32 summed row gradients)
on the parameter (engram/models/table_grad.py), so nothing of the table's size is allocated. No table
is ever gathered or replicated, and no sparse tensor is used (HCCL rejects them). Only the plain c10d `all_to_all_single` is used, with
explicit split sizes (the list form fails on gloo with uneven sizes).

Gradient semantics: each rank's loss is the mean over its local batch, so the owners receive the
sum over the ranks that looked the rows up; `grad_scale` turns that into the mean the caller
needs, exactly once (parallelize_model: 1 / dp, since the tp ranks of a replica look up disjoint
tokens of the same loss). FSDP must
not manage these parameters: pass the returned list to `fully_shard(..., ignored_params=...)`.

The lookup's id half (`route_ids`) and restore (`restore_rows`) are shared with host-resident
tables (parallelisms/host_tables.py), whose owners gather from host memory instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from engram.models.table_grad import (
    accumulate_row_grad,
    bag_sums,
    coalesce_rows,
    embedding_lookup,
    sort_rows,
)
from engram.runtime.host_worker import mark_host_resident

__all__ = [
    "ShardedEngramTable",
    "apply_engram_table_sharding",
    "local_row_range",
    "row_chunk",
    "sharded_embedding_lookup",
]


def row_chunk(num_rows: int, world_size: int) -> int:
    """Rows per rank under the torch.chunk split: ceil(num_rows / world_size)."""
    return max(1, math.ceil(num_rows / world_size))


def local_row_range(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the rows `rank` owns (empty when the split runs out before it)."""
    c = row_chunk(num_rows, world_size)
    start = min(num_rows, rank * c)
    return start, min(num_rows, start + c)


def _check_ids(ids: torch.Tensor, num_rows: int) -> None:
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"Engram table ids must be int64 or int32, got {ids.dtype}")
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    lo_v, hi_v = int(lo), int(hi)  # one host sync; the count exchange needs one anyway
    if lo_v < 0 or hi_v >= num_rows:
        raise IndexError(
            f"Engram table ids must lie in [0, {num_rows}), got [{lo_v}, {hi_v}]: the hash "
            "offsets or the table size (vocab_size_per_ngram / primes) do not match the table"
        )


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    # Sum duplicate-row gradients in fp32 when the table is bf16 / fp16.
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _exchange(
    x: torch.Tensor,
    out_rows: int,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    if dist.get_world_size(group) == 1:  # a group of one (host tables at world 1): no collective
        return x.contiguous()
    out = x.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )
    return out


@dataclass
class LookupRoute:
    """Where a lookup's ids go (the id half of the all-to-all lookup, see route_ids)."""

    local_idx: torch.Tensor  # owner side: rows of this rank's shard requested, in receive order
    restore: torch.Tensor  # requester side: inverse of the dedup (dedup) or the sort order
    order: torch.Tensor | None  # the stable sort order (no dedup, or dedup on CPU)
    runs: torch.Tensor | None  # CPU dedup: run lengths of the sorted ids (kept for backward)
    dedup: bool
    send_splits: list[int]
    recv_splits: list[int]
    n_send: int
    n_recv: int


def route_ids(
    ids: torch.Tensor, num_rows: int, local_rows: int, group: dist.ProcessGroup, dedup: bool
) -> LookupRoute:
    """Send the (deduplicated) ids to their owners: counts and ids all-to-all (collective).

    `ids`: flat int64 on the device the exchange runs on. Checks that this rank holds the
    `local_rows` rows the torch.chunk split gives it."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    c = row_chunk(num_rows, world)
    start, stop = local_row_range(num_rows, rank, world)
    if local_rows != stop - start:
        raise ValueError(
            f"rank {rank} holds {local_rows} table rows but the torch.chunk split "
            f"of {num_rows} rows over {world} ranks gives it {stop - start}: shard the table "
            "with apply_engram_table_sharding (Shard(0) on the same group)"
        )
    # Ids sorted by owner: the owner is monotonic in the id.
    order, runs = None, None
    if dedup and ids.device.type == "cpu":
        # One stable sort, kept for backward: its duplicate-row sum then needs no other sort.
        order, send_ids, runs = sort_rows(ids)
        restore = torch.empty_like(order).scatter_(0, order, torch.repeat_interleave(runs))
    elif dedup:
        send_ids, restore = torch.unique(ids, sorted=True, return_inverse=True)
    else:
        order = torch.argsort(ids, stable=True)
        send_ids, restore = ids[order], order
    send_counts = torch.bincount(send_ids // c, minlength=world)
    if world == 1:
        recv_counts = send_counts
    else:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    counts = torch.cat([send_counts, recv_counts]).tolist()
    send_splits, recv_splits = counts[:world], counts[world:]
    n_send, n_recv = sum(send_splits), sum(recv_splits)
    recv_ids = _exchange(send_ids, n_recv, recv_splits, send_splits, group)
    return LookupRoute(
        recv_ids - start, restore, order, runs, dedup, send_splits, recv_splits, n_send, n_recv
    )


def restore_rows(route: LookupRoute, rows_back: torch.Tensor) -> torch.Tensor:
    """The requester's rows in the order of its ids, from the rows its owners sent back."""
    if route.dedup:
        return rows_back.index_select(0, route.restore)
    out = torch.empty_like(rows_back)
    out[route.order] = rows_back
    return out


def save_route(ctx, route: LookupRoute, group, grad_scale, dtype, wire, local_shape) -> None:
    """What the backward of a routed lookup needs (_route_grads_to_owners reads it)."""
    ctx.save_for_backward(route.local_idx, route.restore, route.order, route.runs)
    ctx.meta = (
        route.dedup,
        grad_scale,
        group,
        route.send_splits,
        route.recv_splits,
        route.n_send,
        route.n_recv,
    )
    ctx.local_shape, ctx.dtype, ctx.wire = local_shape, dtype, wire


class _ShardedLookup(torch.autograd.Function):
    """out[i] = table[ids[i]] for a row-sharded table; see sharded_embedding_lookup."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        local_weight: torch.Tensor,
        flat_ids: torch.Tensor,
        num_rows: int,
        group: dist.ProcessGroup,
        dedup: bool,
        grad_scale: float,
        wire_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        ids = flat_ids.to(device=local_weight.device, dtype=torch.long)
        route = route_ids(ids, num_rows, local_weight.shape[0], group, dedup)
        # Rows (and, in backward, row gradients) may travel in a narrower dtype than the table
        # (parallelism.engram_a2a_dtype): half the bytes in bf16; the optimizer stays fp32.
        wire = wire_dtype or local_weight.dtype
        rows = local_weight.index_select(0, route.local_idx).to(wire)
        rows_back = _exchange(rows, route.n_send, route.send_splits, route.recv_splits, group)
        out = restore_rows(route, rows_back.to(local_weight.dtype))
        save_route(ctx, route, group, grad_scale, local_weight.dtype, wire, local_weight.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        local_idx, grad_recv = _route_grads_to_owners(ctx, grad_out)
        acc = _accumulate_dtype(ctx.dtype)
        grad_local = grad_recv.new_zeros(ctx.local_shape, dtype=acc)
        grad_local.index_add_(0, local_idx, grad_recv.to(acc))
        return grad_local.to(ctx.dtype), None, None, None, None, None, None


def _route_grads_to_owners(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward all-to-all: (local row ids, row gradients) this rank owns, as received (a row
    may appear once per sending rank); grad_scale applied."""
    local_idx, restore, order, runs = ctx.saved_tensors
    dedup, grad_scale, group, send_splits, recv_splits, n_send, n_recv = ctx.meta
    acc = _accumulate_dtype(ctx.dtype)
    grad_out = grad_out.contiguous()
    if dedup and runs is not None:  # CPU: the forward's sort (same sums as coalesce_rows)
        grad_send = bag_sums(grad_out.to(acc), order, runs)
    elif dedup:  # rows repeated in this rank's batch: sum them before sending (every one of the
        # n_send unique ids occurs, so the coalesced rows are exactly 0..n_send-1)
        grad_send = coalesce_rows(restore, grad_out.to(acc))[1].to(acc)
    else:
        grad_send = grad_out.index_select(0, restore).to(acc)
    if grad_scale != 1.0:
        grad_send.mul_(grad_scale)
    grad_recv = _exchange(grad_send.to(ctx.wire), n_recv, recv_splits, send_splits, group)
    return local_idx, grad_recv.to(acc)


class _RowSparseShardedLookup(_ShardedLookup):
    """_ShardedLookup whose backward leaves the owner's (unique local rows, fp32 summed row grads)
    on `param` (engram/models/table_grad.py) and returns no dense gradient: O(touched rows)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local_weight, flat_ids, num_rows, group, dedup, grad_scale, wire_dtype, param
    ) -> torch.Tensor:
        ctx.param = param
        return _ShardedLookup.forward(
            ctx, local_weight, flat_ids, num_rows, group, dedup, grad_scale, wire_dtype
        )

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        local_idx, grad_recv = _route_grads_to_owners(ctx, grad_out)
        accumulate_row_grad(ctx.param, *coalesce_rows(local_idx, grad_recv))
        return None, None, None, None, None, None, None, None


def sharded_embedding_lookup(
    ids: torch.Tensor,
    local_weight: torch.Tensor,
    num_rows: int,
    group: dist.ProcessGroup,
    dedup: bool = True,
    grad_scale: float = 1.0,
    param: torch.Tensor | None = None,
    wire_dtype: torch.dtype | None = None,
    row_sparse: bool = False,
) -> torch.Tensor:
    """Look up rows of a table row-sharded over `group`; returns [*ids.shape, d].

    `local_weight` is this rank's shard (torch.chunk split of `num_rows` rows). Collective: every
    rank of `group` must call it, in the same order, even with an empty `ids`. With `dedup`, each
    distinct id is sent once per rank. The table gradient is scaled by `grad_scale` (use 1 / W for
    data-parallel mean semantics when each rank's loss is its local mean). A group of one rank is a
    plain gather with no communication. With `row_sparse`, the backward leaves row-sparse
    gradients (engram/models/table_grad.py) on `param` (the table parameter whose local piece is
    `local_weight`) instead of a dense gradient. `wire_dtype` (default: the table's dtype) is the
    dtype rows and row gradients travel in through the all-to-all.
    """
    if local_weight.dim() != 2:
        raise ValueError(f"local_weight must be [rows, dim], got shape {tuple(local_weight.shape)}")
    _check_ids(ids, num_rows)
    if dist.get_world_size(group) == 1:  # a plain gather, no communication
        if local_weight.shape[0] != num_rows:
            raise ValueError(f"one rank must hold all {num_rows} rows, has {local_weight.shape[0]}")
        return embedding_lookup(ids, local_weight, param, grad_scale, row_sparse)
    if row_sparse and param is None:
        raise ValueError("row_sparse lookups need `param`, the parameter that keeps the row grads")
    if row_sparse and local_weight.requires_grad:
        out = _RowSparseShardedLookup.apply(
            local_weight, ids.reshape(-1), num_rows, group, dedup, grad_scale, wire_dtype, param
        )
    else:
        out = _ShardedLookup.apply(
            local_weight, ids.reshape(-1), num_rows, group, dedup, grad_scale, wire_dtype
        )
    return out.view(*ids.shape, local_weight.shape[1])


class ShardedEngramTable(nn.Module):
    """Mixin put in front of a table's class by apply_engram_table_sharding.

    The table keeps its attributes (reset_parameters, ...); only forward changes: the lookup runs
    on the local Shard(0) of `weight` and returns full rows.
    """

    weight: nn.Parameter
    _engram_group: dist.ProcessGroup
    _engram_dedup: bool
    _engram_grad_scale: float
    _engram_wire_dtype: torch.dtype | None
    _engram_row_sparse: bool

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return sharded_embedding_lookup(
            ids,
            self.weight.to_local(),
            self.weight.shape[0],
            self._engram_group,
            self._engram_dedup,
            self._engram_grad_scale,
            param=self.weight,
            wire_dtype=self._engram_wire_dtype,
            row_sparse=self._engram_row_sparse,
        )

    def extra_repr(self) -> str:
        return (
            f"rows={self.weight.shape[0]}, dim={self.weight.shape[1]}, "
            f"sharded over {dist.get_world_size(self._engram_group)} ranks, dedup={self._engram_dedup}, "
            f"row_sparse={self._engram_row_sparse}"
        )


_SHARDED_CLASSES: dict[tuple[type, str], type] = {}


def _sharded_class(cls: type, location: str) -> type:
    if (cls, location) not in _SHARDED_CLASSES:
        from parallelisms.host_tables import HostShardedEngramTable  # imports this module

        mixin, prefix = (
            (HostShardedEngramTable, "HostSharded") if location == "host"
            else (ShardedEngramTable, "Sharded")
        )  # fmt: skip
        _SHARDED_CLASSES[(cls, location)] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    return _SHARDED_CLASSES[(cls, location)]


def _default_table_types() -> tuple[type, ...]:
    from engram.models.engram import EngramTable  # lazy: keeps this module importable on its own

    return (EngramTable,)


def apply_engram_table_sharding(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    grad_scale: float,
    dedup: bool = True,
    row_sparse: bool = False,
    table_types: tuple[type, ...] | None = None,
    wire_dtype: torch.dtype | None = None,
    location: str = "device",
) -> list[nn.Parameter]:
    """Row-shard every Engram table of `model` over the 1-D `mesh`; return the table params.

    Each table's `weight` becomes `nn.Parameter(DTensor)` with Shard(0) (works on the meta device;
    a materialised weight is sliced to the local rows) and its forward becomes the all-to-all
    lookup. `grad_scale` multiplies the table gradient the owners receive (the sum over the
    ranks that looked the rows up, each differentiating its local-mean loss): 1 / dp for the
    data-parallel mean, which is 1 / mesh size only without TP (parallelize_model passes it).
    `row_sparse`: the backward leaves row-sparse gradients for a row-sparse optimizer
    (engram/config/table_optimizers.py) instead of a dense gradient. The returned list is in module
    order (identical on every rank): pass it to `fully_shard(..., ignored_params=...)` and give
    it its own optimizer group. `table_types` defaults to engram.models.engram.EngramTable.
    `wire_dtype`: dtype of the rows and row gradients in the all-to-all (None: the table's).
    `location`: "device" | "host" (engram.table_location): a host table keeps its shard in host
    memory and looks up through a host gather (parallelisms/host_tables.py); it needs a
    row-sparse table optimizer (lazy_adam / rowwise_adagrad).
    """
    if location not in ("device", "host"):
        raise ValueError(f"table location must be 'device' or 'host', got {location!r}")
    if location == "host" and not row_sparse:
        raise ValueError(
            "host-resident Engram tables need row_sparse=True (a row-sparse table optimizer: "
            "lazy_adam or rowwise_adagrad)"
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"Engram tables shard over a 1-D mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}: "
            "pass the 'engram' sub-mesh, e.g. world_mesh['engram']"
        )
    types = table_types if table_types is not None else _default_table_types()
    world, rank = mesh.size(), mesh.get_local_rank()
    scale = float(grad_scale)
    group = mesh.get_group()
    params: list[nn.Parameter] = []
    for module in model.modules():
        if not isinstance(module, types):
            continue
        if isinstance(module, ShardedEngramTable):
            raise ValueError(f"{type(module).__name__} is already sharded: apply the sharding once")
        weight = module.weight
        if weight.dim() != 2:
            raise ValueError(f"Engram table weight must be [rows, dim], got {tuple(weight.shape)}")
        start, stop = local_row_range(weight.shape[0], rank, world)
        local = weight.detach()[start:stop].clone()  # on meta this allocates nothing
        dt = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=weight.stride()
        )
        module.weight = nn.Parameter(dt, requires_grad=weight.requires_grad)
        module.__class__ = _sharded_class(type(module), location)
        if location == "host":
            from parallelisms.host_tables import init_host_table  # imports this module

            mark_host_resident(module.weight)
            init_host_table(module)
        module._engram_group = group
        module._engram_dedup = dedup
        module._engram_grad_scale = scale
        module._engram_wire_dtype = wire_dtype
        module._engram_row_sparse = row_sparse
        params.append(module.weight)
    return params
