"""What the device and the host lookup share: the torch.chunk row split, the id half of the
all-to-all lookup (ids to their owners, `route_ids`), putting the rows back in the requester's
order (`restore_rows`) and the backward's exchange of row gradients to their owners
(`save_route` in forward, `route_grads_to_owners` in backward).

Only the plain c10d `all_to_all_single` is used, with explicit split sizes (the list form fails
on gloo with uneven sizes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engram.models.table_grad import bag_sums, coalesce_rows, sort_rows

__all__ = [
    "LookupRoute",
    "LookupSettings",
    "accumulate_dtype",
    "check_ids",
    "exchange",
    "local_row_range",
    "restore_rows",
    "route_grads_to_owners",
    "route_ids",
    "row_chunk",
    "save_route",
]


def row_chunk(num_rows: int, world_size: int) -> int:
    """Rows per rank under the torch.chunk split: ceil(num_rows / world_size)."""
    return max(1, math.ceil(num_rows / world_size))


def local_row_range(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the rows `rank` owns (empty when the split runs out before it)."""
    c = row_chunk(num_rows, world_size)
    start = min(num_rows, rank * c)
    return start, min(num_rows, start + c)


def check_ids(ids: torch.Tensor, num_rows: int) -> None:
    """Refuse ids that are not integers in [0, num_rows)."""
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


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sum duplicate-row gradients in fp32 when the table is bf16 / fp16."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def exchange(
    x: torch.Tensor,
    out_rows: int,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """One all_to_all_single of the rows of `x` with these split sizes (none on a group of one)."""
    if dist.get_world_size(group) == 1:  # a group of one (host tables at world 1): no collective
        return x.contiguous()
    out = x.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )
    return out


@dataclass(frozen=True)
class LookupSettings:
    """How a sharded table looks up, fixed when it is sharded (apply_engram_table_sharding)."""

    group: dist.ProcessGroup  # the 1-D "engram" group the rows are split over
    dedup: bool  # send each distinct id once per rank
    grad_scale: float  # multiplies the row gradients the owners receive (1 / dp: the mean)
    wire_dtype: torch.dtype | None  # dtype of rows and row gradients in the all-to-all
    row_sparse: bool  # backward leaves row-sparse gradients (engram/models/table_grad.py)


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
    recv_ids = exchange(send_ids, n_recv, recv_splits, send_splits, group)
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
    """What the backward of a routed lookup needs (route_grads_to_owners reads it)."""
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


def route_grads_to_owners(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward all-to-all: (local row ids, row gradients) this rank owns, as received (a row
    may appear once per sending rank); grad_scale applied."""
    local_idx, restore, order, runs = ctx.saved_tensors
    dedup, grad_scale, group, send_splits, recv_splits, n_send, n_recv = ctx.meta
    acc = accumulate_dtype(ctx.dtype)
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
    grad_recv = exchange(grad_send.to(ctx.wire), n_recv, recv_splits, send_splits, group)
    return local_idx, grad_recv.to(acc)
