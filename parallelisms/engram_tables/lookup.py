"""The device lookup of a row-sharded Engram table: an all-to-all of ids and rows.

Each table is a DTensor with placement Shard(0) on a 1-D "engram" mesh (the torch.chunk split of
routing.py). A lookup sends each id to the rank that owns its row and brings the row back; the
backward sends the row gradients to the owners, which add them into a dense gradient of their
shard, or, for a table sharded with `row_sparse=True` (its optimizer is row-sparse: lazy_adam /
rowwise_adagrad), keep (unique local rows, fp32 summed row gradients) on the parameter
(engram/models/table_grad.py), so nothing of the table's size is allocated. No table is ever
gathered or replicated, and no sparse tensor is used (HCCL rejects them).

Gradient semantics: the owners receive the sum over the ranks that looked the rows up;
`grad_scale` multiplies it, exactly once. In training each rank's loss is its share of the step's
token mean (engram/train/loss.py), so that sum is the gradient and parallelize_model passes 1 (the
tp ranks of a replica look up disjoint tokens of the same loss); DeepSpeed's step passes 1 / dp
(runner/engine_step.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engram.models.table_grad import accumulate_row_grad, coalesce_rows, embedding_lookup
from parallelisms.engram_tables.routing import (
    LookupSettings,
    accumulate_dtype,
    check_ids,
    exchange,
    restore_rows,
    route_grads_to_owners,
    route_ids,
    save_route,
)

__all__ = ["ShardedEngramTable", "sharded_embedding_lookup"]


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
        rows_back = exchange(rows, route.n_send, route.send_splits, route.recv_splits, group)
        out = restore_rows(route, rows_back.to(local_weight.dtype))
        save_route(ctx, route, group, grad_scale, local_weight.dtype, wire, local_weight.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        local_idx, grad_recv = route_grads_to_owners(ctx, grad_out)
        acc = accumulate_dtype(ctx.dtype)
        grad_local = grad_recv.new_zeros(ctx.local_shape, dtype=acc)
        grad_local.index_add_(0, local_idx, grad_recv.to(acc))
        return grad_local.to(ctx.dtype), None, None, None, None, None, None


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
        local_idx, grad_recv = route_grads_to_owners(ctx, grad_out)
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
    check_ids(ids, num_rows)
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
    on the local Shard(0) of `weight` and returns full rows. A class swap runs no __init__:
    `lookup` is set once, by `set_lookup`, which apply_engram_table_sharding calls right after
    the swap.
    """

    weight: nn.Parameter
    lookup: LookupSettings
    """How this table looks up (group, dedup, grad_scale, wire dtype, row-sparse backward)."""

    def set_lookup(self, settings: LookupSettings) -> None:
        """State the lookup's settings (once, at sharding time)."""
        self.lookup = settings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = self.lookup
        return sharded_embedding_lookup(
            ids,
            self.weight.to_local(),
            self.weight.shape[0],
            s.group,
            s.dedup,
            s.grad_scale,
            param=self.weight,
            wire_dtype=s.wire_dtype,
            row_sparse=s.row_sparse,
        )

    def extra_repr(self) -> str:
        s = self.lookup
        return (
            f"rows={self.weight.shape[0]}, dim={self.weight.shape[1]}, "
            f"sharded over {dist.get_world_size(s.group)} ranks, dedup={s.dedup}, "
            f"row_sparse={s.row_sparse}"
        )
