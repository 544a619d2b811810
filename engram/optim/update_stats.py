"""What a table update did, on log steps: rows touched and the size of the update on them.

Per table parameter, on this rank (the owner's shard: rows are disjoint over the ranks, so the
sums of the ranks add up to the table's):

    touched     rows the update touched (a row-sparse optimizer: the rows of its row gradient,
                i.e. every row the step looked up; dense adam: the rows with a non-zero gradient)
    update_sq   sum of squares of what the update added to those rows' weights
    update_n    number of values in those rows

so RMS = sqrt(update_sq / update_n). "What the update added" is the optimizer's step (lr x its
direction); the decoupled weight decay (optimizer.table_weight_decay, 0 by default) is not in it.

Armed by engram/train/telemetry.py on log steps only: a row-sparse optimizer
(engram/optim/lazy_adam.py) records into `RowSparseOptimizer.update_stats` while it updates
(also on the host worker, for host / NVMe tables: read after wait_host_work); torch's dense
AdamW (`adam`) knows nothing of it, so `mark_dense_touched` reads the gradients before its step
and `dense_adam_update` recomputes the step it took from its state after. Values stay on the
tables' devices: nothing here reads them on the host.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["TableUpdateStats", "dense_adam_update", "mark_dense_touched"]

_CHUNK_ROWS = 1 << 16  # dense adam's recomputed step, this many rows at a time: bounded memory


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TableUpdateStats:
    """Per table parameter (by identity): touched rows, update_sq, update_n (module docstring).
    Counts may be ints or device tensors; `values` sums them per parameter."""

    def __init__(self) -> None:
        self.touched: dict[int, torch.Tensor | int] = {}
        self.update_sq: dict[int, torch.Tensor] = {}
        self.update_n: dict[int, torch.Tensor | int] = {}
        self._masks: dict[int, torch.Tensor] = {}  # dense adam: touched rows, before its step

    def add_rows(self, param: torch.Tensor, rows: int | torch.Tensor) -> None:
        key = id(param)
        self.touched[key] = self.touched.get(key, 0) + rows

    def add_update(self, param: torch.Tensor, delta: torch.Tensor) -> None:
        """`delta`: what the update added to the touched rows ([rows, dim], any device)."""
        key = id(param)
        sq = delta.detach().float().pow(2).sum()
        self.update_sq[key] = self.update_sq[key] + sq if key in self.update_sq else sq
        self.update_n[key] = self.update_n.get(key, 0) + delta.numel()

    def values(self, param: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[touched, update_sq, update_n] of `param` as one fp32 tensor on `device` (zeros for a
        table this step did not update)."""
        key = id(param)
        parts = [self.touched.get(key, 0), self.update_sq.get(key, 0.0), self.update_n.get(key, 0)]
        return torch.stack([
            v.to(device, torch.float32) if isinstance(v, torch.Tensor)
            else torch.full((), float(v), device=device)
            for v in parts
        ])  # fmt: skip


@torch.no_grad()
def mark_dense_touched(stats: TableUpdateStats, param: torch.Tensor) -> None:
    """Before a dense optimizer's step: the rows of `param` with a non-zero gradient (a count
    on the device: no host read)."""
    if param.grad is None:
        return
    mask = _local(param.grad).ne(0).any(dim=1)
    stats._masks[id(param)] = mask
    stats.add_rows(param, mask.sum())


@torch.no_grad()
def dense_adam_update(
    stats: TableUpdateStats, optimizer: torch.optim.Optimizer, param: torch.Tensor
) -> None:
    """After torch's Adam / AdamW step: the step it added to the touched rows, recomputed from
    its new state as torch computes it (lr / bias_correction1 x exp_avg / (sqrt(exp_avg_sq) /
    sqrt(bias_correction2) + eps)), a chunk of rows at a time."""
    mask = stats._masks.pop(id(param), None)
    state = optimizer.state.get(param)
    if mask is None or not state or "exp_avg" not in state:
        return
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], group["eps"]
    m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
    step = torch.as_tensor(_local(state["step"]), dtype=torch.float32).to(m.device)  # no host read
    bc1, bc2_sqrt = 1 - torch.pow(beta1, step), (1 - torch.pow(beta2, step)).sqrt()
    sq = torch.zeros((), dtype=torch.float32, device=m.device)
    for r0 in range(0, m.shape[0], _CHUNK_ROWS):
        rows = slice(r0, r0 + _CHUNK_ROWS)
        step_rows = m[rows].float() / (v[rows].float().sqrt() / bc2_sqrt + eps) * (lr / bc1)
        sq += (step_rows.pow(2).sum(dim=1) * mask[rows]).sum()
    key = id(param)
    stats.update_sq[key] = stats.update_sq.get(key, 0.0) + sq
    stats.update_n[key] = stats.update_n.get(key, 0) + stats.touched[key] * m.shape[1]
