"""Row-sparse table optimizers: work per step is O(rows touched), never O(table).

Both read the gradient a row-sparse table lookup leaves on the parameter as (unique local row ids,
summed fp32 row gradients) (engram/models/table_grad.py; parallelize_model makes the lookups row-sparse
when optimizer.table_optimizer is, engram/config/table_optimizers.py), so their backward never allocates
a dense gradient. A dense `.grad` (a table looked up densely, or DCP's state initialisation) is
accepted too: its touched rows are then the rows with a non-zero
gradient, which costs O(table).

- LazyAdam: torch.optim.SparseAdam's update on the touched rows (same operations in the same
  order, so equal on the same gradients). Untouched rows keep weights and moments; bias
  correction uses one step count per table, advanced every step the table got a gradient.
- RowwiseAdagrad: FBGEMM's exact row-wise Adagrad: one fp32 accumulator per ROW (the mean over
  the row of the squared gradient), 4 B per row instead of Adam's 8 B per parameter.

Works on DTensor tables (Shard(0) rows): the update runs on `.to_local()` views, and the state
tensors are DTensors with the table's mesh and placements, so DCP saves and reshards them.
`weight_decay` is decoupled and applied to touched rows only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from engram.models.table_grad import clear_row_grad, coalesce_rows, row_grad
from engram.optim.touched_rows import TouchedRows
from engram.optim.update_stats import TableUpdateStats
from engram.rowstore.host_worker import HOST_WORKER, is_host_resident, row_store_of, wait_host_work
from engram.rowstore.streamed_columns import ColumnSource, placeholder, source_of, streaming
from engram.runtime.distributed import placed_like


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class RowSparseOptimizer(torch.optim.Optimizer):
    """Base: checks its parameters are 2-D tables, collects their row gradients, clears them."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        lr, eps = defaults["lr"], defaults["eps"]
        if lr < 0.0 or eps < 0.0 or defaults["weight_decay"] < 0.0:
            raise ValueError(
                f"invalid lr {lr} / eps {eps} / weight_decay {defaults['weight_decay']}: must be >= 0"
            )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"{type(self).__name__} updates rows of 2-D tables, got a {p.dim()}-D "
                        f"parameter of shape {tuple(p.shape)}: put it in a regular Adam/AdamW"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Collect every table's row gradient and the group's hyper-parameters now, then update:
        here, or for tables outside device memory (engram.table_location host / nvme) on the
        host worker (engram/rowstore/host_worker.py), which overlaps the next forward (its later
        gathers queue behind the update: exact)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work, stats = [], self.update_stats
        for group in self.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}  # lr moves on after step
            for p in group["params"]:
                rg = self._row_grad(p)
                if rg is not None:
                    work.append((p, hyper, rg))
                    if self.touched is not None:  # incremental table checkpoints
                        self.touched.add(p, rg[0])
                    if stats is not None:  # a log step (engram/train/telemetry.py)
                        stats.add_rows(p, rg[0].numel())
        if any(is_host_resident(p) for p, _, _ in work):
            HOST_WORKER.submit(self._update_all, work, stats)
        else:
            self._update_all(work, stats)
        return loss

    @torch.no_grad()  # grad mode is per thread: the host worker needs its own
    def _update_all(self, work: list, stats: TableUpdateStats | None = None) -> None:
        for p, hyper, rg in work:
            delta = self._update(p, hyper, *rg)
            if stats is not None and delta is not None:
                stats.add_update(p, delta)

    touched: TouchedRows | None = None
    """Set by the checkpointer when it saves incremental table checkpoints: every step records
    the rows it updates there (engram/optim/touched_rows.py)."""

    update_stats: TableUpdateStats | None = None
    """Set on log steps (engram/train/telemetry.py): the step records its touched rows and the
    size of its update there (engram/optim/update_stats.py); values are unchanged."""

    ROW_STATE: dict[str, bool] = {}
    """The optimizer's state tensors: name -> one value per table parameter (True, shaped like
    the table) or one per row (False). A row store (engram.table_location = nvme) keeps them
    next to each row's weight."""

    def _update(
        self, p: torch.Tensor, hyper: dict, rows: torch.Tensor, g: torch.Tensor
    ) -> torch.Tensor | None:
        """Update rows `rows` of `p` with their gradient `g`: in `p`'s tensors, or for a table in
        a row store on its rows read out, updated by the same code, and written back (equal
        values: the update is element-wise per row). Returns what it added to the rows."""
        state = self.state[p]
        store = row_store_of(p)
        if store is None:
            if not state:
                self._init_state(p, state, tensors=True)
            tensors = {"weight": _local(p), **{k: _local(state[k]) for k in self.ROW_STATE}}
            return self._update_rows(tensors, state, hyper, rows, g)
        if not state:
            self._init_state(p, state, tensors=False)
        compact = store.read_columns(rows) if rows.numel() else {}
        delta = self._update_rows(compact, state, hyper, torch.arange(rows.numel()), g)
        if rows.numel():
            store.write_columns(rows, compact)
        store.release_all()  # the step's lookups and update are done with its pinned rows
        return delta

    def _init_state(self, p: torch.Tensor, state: dict, tensors: bool) -> None:
        """The state of a table's first update: its ROW_STATE tensors, or without `tensors`
        (a row store holds them) memoryless stand-ins of their shape, so that whoever lists the
        state's names (DCP's flattened state dict) finds them; state_dict reads the store."""
        for name, per_param in self.ROW_STATE.items():
            state[name] = self._rows_state(p, row_shape=not per_param, hollow=not tensors)

    def _update_rows(
        self, t: dict, state: dict, hyper: dict, rows: torch.Tensor, g: torch.Tensor
    ) -> torch.Tensor | None:
        """The update of rows `rows` of t["weight"] and the ROW_STATE tensors in `t`; returns
        what it added to the rows (weight decay aside), None when no row."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        wait_host_work()  # host updates still queued write the state
        out = super().state_dict()
        # A table in a row store: its state columns, read out, as the tensors a host table holds
        # (DCP saves and reshards them alike; the store's files are not the checkpoint), or
        # while a checkpoint streams, placeholders (engram/rowstore/streamed_columns.py).
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            store = row_store_of(p)
            if store is not None and i in out["state"]:
                if streaming():
                    columns = {k: placeholder(p, ColumnSource(store, k)) for k in self.ROW_STATE}
                else:
                    columns = {k: placed_like(p, store.snapshot(k)) for k in self.ROW_STATE}
                out["state"][i] = {**out["state"][i], **columns}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        wait_host_work()
        state_dict = {**state_dict, "state": dict(state_dict["state"])}
        # the saved parameters' keys (ints, or FQNs from DCP) pair with ours in group order, as
        # in torch's own load_state_dict
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        ours = [p for g in self.param_groups for p in g["params"]]
        for key, p in zip(saved, ours, strict=False):  # a mismatch: torch says so below
            store = row_store_of(p)
            if store is not None and key in state_dict["state"]:
                entry = dict(state_dict["state"][key])
                columns = {k: entry.pop(k) for k in self.ROW_STATE if k in entry}
                # a placeholder's rows went (or stay) in the store
                store.load(
                    {k: _local(v).to("cpu") for k, v in columns.items() if source_of(v) is None}
                )
                state_dict["state"][key] = entry
        super().load_state_dict(state_dict)
        for p in ours:
            if row_store_of(p) is not None and self.state.get(p):
                self._init_state(p, (stand_ins := {}), tensors=False)
                self.state[p] |= {k: stand_ins[k] for k in self.ROW_STATE}

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                clear_row_grad(p)

    @staticmethod
    def _row_grad(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(unique local rows, fp32 row grads) on the shard's device (host memory for a host
        table), or None when the table got no gradient."""
        rg = RowSparseOptimizer._all_row_grads(p)
        if rg is None:
            return None
        device = "cpu" if row_store_of(p) is not None else _local(p).device
        return rg[0].to(device), rg[1].to(device)

    @staticmethod
    def _all_row_grads(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        rg = row_grad(p)
        if p.grad is None:
            return rg
        dense = _local(p.grad)
        rows = dense.ne(0).any(dim=1).nonzero().squeeze(1)
        pairs = [(rows, dense.index_select(0, rows).float())] + ([rg] if rg is not None else [])
        if len(pairs) == 1:
            return pairs[0]
        return coalesce_rows(torch.cat([r for r, _ in pairs]), torch.cat([v for _, v in pairs]))

    def _rows_state(self, p: torch.Tensor, row_shape: bool, hollow: bool = False) -> torch.Tensor:
        """Zero state for `p`: like p (row_shape False) or one fp32 value per row (True);
        `hollow`: a zero-stride view of one fp32 zero of that shape (no memory)."""
        if not (row_shape or hollow):
            return torch.zeros_like(p, memory_format=torch.preserve_format)
        shape = _local(p).shape[:1] if row_shape else _local(p).shape
        if hollow:
            return placed_like(p, torch.zeros(1).expand(*shape))
        return placed_like(p, torch.zeros(shape, dtype=torch.float32, device=_local(p).device))

    @staticmethod
    def _decay_rows(param: torch.Tensor, rows: torch.Tensor, factor: float) -> None:
        param.index_copy_(0, rows, param.index_select(0, rows).mul_(factor))

    @staticmethod
    def _add_rows(param: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """param[rows] += delta for UNIQUE rows (read, add, write back); returns delta."""
        new = param.index_select(0, rows).float().add_(delta)
        param.index_copy_(0, rows, new.to(param.dtype))
        return delta


class LazyAdam(RowSparseOptimizer):
    """Adam on touched rows only; equal to torch.optim.SparseAdam on the same gradients."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must lie in [0, 1)")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    ROW_STATE = {"exp_avg": True, "exp_avg_sq": True}

    def _init_state(self, p: torch.Tensor, state: dict, tensors: bool) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        super()._init_state(p, state, tensors)

    def _update_rows(
        self, t: dict, state: dict, hyper: dict, rows: torch.Tensor, g: torch.Tensor
    ) -> None:
        lr, (beta1, beta2) = float(hyper["lr"]), hyper["betas"]
        eps, weight_decay = hyper["eps"], hyper["weight_decay"]
        state["step"] += 1  # every rank, also one that owns no touched row
        step = int(state["step"].item())
        if rows.numel() == 0:
            return None
        param, exp_avg, exp_avg_sq = t["weight"], t["exp_avg"], t["exp_avg_sq"]
        if weight_decay != 0:
            self._decay_rows(param, rows, 1 - lr * weight_decay)
        # torch.optim._functional.sparse_adam on (rows, values), same values: rows are
        # unique, so each state row is read once and written back (index_copy_ is
        # several times faster than index_add_ on CPU).
        old_exp_avg = exp_avg.index_select(0, rows).float()
        numer = g.sub(old_exp_avg).mul_(1 - beta1).add_(old_exp_avg)
        exp_avg.index_copy_(0, rows, numer.to(exp_avg.dtype))
        old_exp_avg_sq = exp_avg_sq.index_select(0, rows).float()
        new_exp_avg_sq = g.pow(2).sub_(old_exp_avg_sq).mul_(1 - beta2).add_(old_exp_avg_sq)
        exp_avg_sq.index_copy_(0, rows, new_exp_avg_sq.to(exp_avg_sq.dtype))
        denom = new_exp_avg_sq.sqrt_().add_(eps)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr * math.sqrt(bias_correction2) / bias_correction1
        return self._add_rows(param, rows, numer.div_(denom).mul_(-step_size))


class RowwiseAdagrad(RowSparseOptimizer):
    """Exact row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD) on touched rows.

    Per touched row r with gradient g_r (length d): sum_r += mean(g_r ** 2);
    w_r -= lr * g_r / (sqrt(sum_r) + eps). State: one fp32 value per row.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "eps": eps, "weight_decay": weight_decay})

    ROW_STATE = {"sum": False}

    def _update_rows(
        self, t: dict, state: dict, hyper: dict, rows: torch.Tensor, g: torch.Tensor
    ) -> None:
        lr, eps, weight_decay = float(hyper["lr"]), hyper["eps"], hyper["weight_decay"]
        if rows.numel() == 0:
            return None
        param, acc = t["weight"], t["sum"]
        if weight_decay != 0:
            self._decay_rows(param, rows, 1 - lr * weight_decay)
        new_acc = acc.index_select(0, rows).add_(g.pow(2).mean(dim=1))
        acc.index_copy_(0, rows, new_acc)
        std = new_acc.sqrt_().add_(eps)
        return self._add_rows(param, rows, (g / std.unsqueeze(1)).mul_(-lr))
