"""Row-sparse gradients for the Engram tables: (unique row ids, summed row gradients), no dense grad.

A table whose optimizer is row-sparse (engram/config/table_optimizers.py: lazy_adam, rowwise_adagrad) is
looked up with `row_sparse=True` (EngramTable(row_sparse=...), or apply_engram_table_sharding's
`row_sparse`, which parallelize_model takes from optimizer.table_optimizer). Its lookup's backward
then returns no gradient for the weight (so `.grad` stays None and no table-sized tensor is
allocated) and instead appends (local row ids, fp32 row gradients) to the parameter; `row_grad` merges everything appended since the last `clear_row_grad`
(micro-batches of gradient accumulation) into unique rows with summed gradients, in fp32. Plain
dense tensors, no torch sparse tensors (HCCL rejects them).

For a DTensor (row-sharded) table the row ids are LOCAL to the rank's Shard(0) piece; the owners'
row sets are disjoint, so the global squared norm is the sum over ranks of each rank's rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from engram.runtime.distributed import shard_groups

_PENDING = "_engram_row_grads"  # list of (rows, values) appended by backward
_MERGED = "_engram_row_grad"  # (rows, values) after merging, cached until cleared


def accumulate_row_grad(param: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Add (rows, values) to the parameter's pending row gradient (called from backward)."""
    pending = getattr(param, _PENDING, None)
    if pending is None:
        pending = []
        setattr(param, _PENDING, pending)
    pending.append((rows, values))


def sort_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, unique sorted rows, counts): rows[order] is sorted (stable: equal rows keep their
    positions' order) and runs of equal rows have lengths `counts`."""
    order = torch.argsort(rows, stable=True)
    uniq, counts = torch.unique_consecutive(rows.index_select(0, order), return_counts=True)
    return order, uniq, counts


def bag_sums(values: torch.Tensor, order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row i: the sum of the values of sort_rows' i-th unique row, in position order (CPU).

    One embedding_bag over the sorted order: index_add_ runs as a scatter_add over an expanded
    index on CPU (6x slower), index_select + segment_reduce as two passes (7x slower)."""
    if counts.numel() == 0:
        return values.new_zeros((0, values.shape[1]))
    starts = counts.cumsum(0).sub_(counts)
    return F.embedding_bag(order, values.contiguous(), starts, mode="sum")


def coalesce_rows(rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique sorted row ids and the sum of each row's values in fp32 (fp64 stays fp64), in a
    deterministic order."""
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    if rows.device.type == "cpu":
        order, uniq, counts = sort_rows(rows)
        return uniq, bag_sums(values, order, counts)
    uniq, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    out = values.new_zeros((uniq.numel(), values.shape[1]))
    out.index_add_(0, inverse, values)
    return uniq, out


def row_grad(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(unique local row ids, summed fp32 row gradients) since the last clear, or None."""
    merged = getattr(param, _MERGED, None)
    pending = getattr(param, _PENDING, None)
    if pending:
        if merged is not None:
            pending = [merged, *pending]
        if len(pending) == 1:
            merged = pending[0]  # backward already coalesced one micro-batch
        else:
            merged = coalesce_rows(
                torch.cat([r for r, _ in pending]), torch.cat([v for _, v in pending])
            )
        setattr(param, _MERGED, merged)
        setattr(param, _PENDING, None)
    return merged


def clear_row_grad(param: torch.Tensor) -> None:
    setattr(param, _PENDING, None)
    setattr(param, _MERGED, None)


def row_grad_norm_sq(params: Iterable[torch.Tensor]) -> dict[tuple, torch.Tensor]:
    """Local squared norms of the row-sparse gradients, bucketed by the groups to sum them over.

    Each row is counted once (rows are unique per owner and owners are disjoint), so adding these
    buckets to the dense ones gives the same global norm as the dense table gradient.
    clip_grad_norm_ all-reduces each bucket over its groups.
    """
    buckets: dict[tuple, torch.Tensor] = {}
    for p in params:
        rg = row_grad(p)
        if rg is None:
            continue
        key = shard_groups(p)
        sq = rg[1].pow(2).sum()
        buckets[key] = buckets[key] + sq if key in buckets else sq
    return buckets


def scale_row_grads_(params: Iterable[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every row-sparse gradient by `coef` in place (gradient clipping)."""
    for p in params:
        rg = row_grad(p)
        if rg is not None:
            rg[1].mul_(coef.to(rg[1].device))


class _RowSparseEmbedding(torch.autograd.Function):
    """F.embedding whose backward stores row-sparse gradients on `param` and returns None."""

    @staticmethod
    def forward(ctx, weight, ids, param, grad_scale):  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.param, ctx.grad_scale = param, grad_scale
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        rows, values = coalesce_rows(ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]))
        if ctx.grad_scale != 1.0:
            values.mul_(ctx.grad_scale)
        accumulate_row_grad(ctx.param, rows, values)
        return None, None, None, None


def embedding_lookup(
    ids: torch.Tensor,
    weight: torch.Tensor,
    param: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    row_sparse: bool = False,
) -> torch.Tensor:
    """weight[ids]; with `row_sparse`, the backward leaves row-sparse gradients on `param`
    (default: `weight`) instead of a dense gradient.

    `weight` may be the local piece of a DTensor `param` (whose ids are then local row ids).
    """
    param = weight if param is None else param
    if row_sparse and torch.is_grad_enabled() and weight.requires_grad:
        return _RowSparseEmbedding.apply(weight, ids, param, grad_scale)
    return _dense_embedding(ids, weight, grad_scale)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.scale, None


def _dense_embedding(ids: torch.Tensor, weight: torch.Tensor, grad_scale: float) -> torch.Tensor:
    w = weight if grad_scale == 1.0 else _ScaleGrad.apply(weight, grad_scale)
    return F.embedding(ids, w)
