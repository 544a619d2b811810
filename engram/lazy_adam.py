"""Lazy row-wise Adam for huge, sparsely touched embedding tables.

Per step only the rows whose gradient row is non-zero ("touched") are updated: their moments,
then their weights. Untouched rows keep weights and moments as they are (TF LazyAdam / torch
SparseAdam semantics, but on dense gradients, since HCCL rejects sparse tensors). Bias correction
uses one global step per parameter. A touched row whose gradient happens to be exactly zero is
treated as untouched.

Works on DTensor parameters (the row-sharded tables): the update runs on `.to_local()` of the
parameter, gradient and moments, which share storage with the DTensors. Moments are created with
`zeros_like(param)`, so they are DTensors of the same placement and DCP saves and reshards them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LazyRowAdam(torch.optim.Optimizer):
    """Adam that updates only the touched rows of 2-D parameters.

    With every row touched it computes exactly what torch.optim.Adam (weight_decay 0) /
    torch.optim.AdamW (decoupled weight_decay) compute with foreach=False. `weight_decay` is
    decoupled and applied to touched rows only.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must lie in [0, 1)")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"invalid eps {eps} / weight_decay {weight_decay}: must be >= 0")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"LazyRowAdam updates rows of 2-D tables, got a {p.dim()}-D parameter of "
                        f"shape {tuple(p.shape)}: put other parameters in a regular Adam/AdamW"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, weight_decay = group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()

                param, grad = _local(p), _local(p.grad)
                rows = grad.ne(0).any(dim=1).nonzero().squeeze(1)
                if rows.numel() == 0:
                    continue
                g = grad.index_select(0, rows)
                m = _local(state["exp_avg"]).index_select(0, rows)
                v = _local(state["exp_avg_sq"]).index_select(0, rows)
                w = param.index_select(0, rows)

                # Same operations, in the same order, as torch.optim.Adam's single-tensor path.
                if weight_decay != 0:
                    w.mul_(1 - lr * weight_decay)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                step_size = lr / (1 - beta1**step)
                denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                w.addcdiv_(m, denom, value=-step_size)

                _local(state["exp_avg"]).index_copy_(0, rows, m)
                _local(state["exp_avg_sq"]).index_copy_(0, rows, v)
                param.index_copy_(0, rows, w)
        return loss
