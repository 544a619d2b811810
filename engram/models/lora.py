"""LoRA adapters on a linear: y = base(x) + scaling * B(A(dropout(x))), scaling = alpha / rank.

`add_lora` swaps the class of an existing `nn.Linear` (or a subclass such as torchao's
`Float8Linear`) for a LoRA subclass of it, in place and on any device (meta included), as
torchtitan's LoRA converter does: the base weight keeps its name (`...wq.weight`, so HF loading
and checkpoints see the same keys) and the base forward stays the parent class's (float8 matmul
included). The adapters are two direct parameters:

    lora_A  [rank, in_features]   normal(0, 1 / in_features), or with init_a = "peft" PEFT's
                                  U(-1/sqrt(in), 1/sqrt(in))   (PEFT: lora_A.weight)
    lora_B  [out_features, rank]  zeros                        (PEFT: lora_B.weight)

B = 0 makes the adapter output exactly 0 at step 0. The adapters compute in high precision (the
parent's float8 recipe is not applied to them). Under tensor parallelism they are DTensors placed
by parallelisms/tensor_parallel.py (column-wise base: A replicated, B sharded like the output;
row-wise base: A sharded like the input, B replicated); the matmuls below then run on DTensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from engram.config import Lora as LoraConfig
from engram.models.init import init_constant_, init_normal_, init_uniform_

LORA_PARAMS = ("lora_A", "lora_B")

_CLASSES: dict[type, type] = {}


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAMS


class LoRAMixin:
    """Put in front of a Linear class by `add_lora`; holds only the adapter logic."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_rank: int
    lora_scaling: float
    lora_dropout: float  # a float, not a Dropout child: TP styles partition every child module
    lora_init_a: str  # "normal" | "peft" (engram.config.Lora.init_a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fusable():
            linear: nn.Linear = self  # type: ignore[assignment]  # the mixin sits on a Linear
            return _FusedLoRALinear.apply(
                x, linear.weight, linear.bias, self.lora_A, self.lora_B, self.lora_scaling
            )
        base = super().forward(x)  # type: ignore[misc]
        h = F.linear(self._dropped(x), self.lora_A)  # [..., rank]
        # One GEMM adds scaling * h B^T onto the base output: no full-size scale or add pass.
        out = torch.addmm(
            base.flatten(0, -2), h.flatten(0, -2), self.lora_B.t(), alpha=self.lora_scaling
        )
        return out.view(base.shape)

    def _fusable(self) -> bool:
        """A plain nn.Linear base on plain tensors without active dropout: the fused path. A
        subclass's own forward (float8), DTensor (TP) weights and dropout take the generic one."""
        base_forward = type(self).__bases__[1].forward
        return (
            base_forward is nn.Linear.forward
            and not isinstance(self.weight, DTensor)  # type: ignore[attr-defined]
            and (self.lora_dropout == 0 or not self.training)  # type: ignore[attr-defined]
        )

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_dropout == 0:
            return x
        return F.dropout(x, self.lora_dropout, self.training)  # type: ignore[attr-defined]

    @torch.no_grad()
    def init_lora(self, seed: int, fqn: str) -> None:
        """Layout-independent init (engram/models/init.py): A normal(0, 1/in) or (init_a =
        "peft") uniform within +-1/sqrt(in) as PEFT's kaiming_uniform(a=sqrt(5)), B zero."""
        # in_features, not lora_A.shape[1]: a ZeRO-3 partitioned parameter's shape is (0,)
        scale = 1.0 / math.sqrt(self.in_features)  # type: ignore[attr-defined]  # on a Linear
        if self.lora_init_a == "peft":
            init_uniform_(self.lora_A, scale, seed, f"{fqn}.lora_A")
        else:
            init_normal_(self.lora_A, scale, seed, f"{fqn}.lora_A")
        init_constant_(self.lora_B, 0.0)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A, the [out, in] update a merged export adds to the base weight (full
        tensors: call on an unsharded model)."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.lora_scaling


class _FusedLoRALinear(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T as 3 GEMMs forward; backward writes the base and adapter
    input gradients into one tensor (addmm_) instead of autograd's two full-size gradients and
    their sum, and skips the frozen base weight's gradient. Same math as the generic path."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ lora_a.t()  # [N, rank]
        base = F.linear(x2, weight, bias)
        out = base.addmm_(h, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x2, weight, lora_a, lora_b, h)
        ctx.scaling = scaling
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x2, weight, lora_a, lora_b, h = ctx.saved_tensors
        s = ctx.scaling
        g2 = grad.reshape(-1, grad.shape[-1])
        need_x, need_w, need_b, need_a, need_lb = ctx.needs_input_grad[:5]
        grad_h = (g2 @ lora_b).mul_(s) if (need_x or need_a) else None  # [N, rank]
        grad_x = grad_w = grad_bias = grad_a = grad_lb = None
        if need_x:
            grad_x = (g2 @ weight).addmm_(grad_h, lora_a).view(*grad.shape[:-1], x2.shape[-1])
        if need_w:
            grad_w = g2.t() @ x2
        if need_b and ctx.has_bias:
            grad_bias = g2.sum(0)
        if need_a:
            grad_a = grad_h.t() @ x2
        if need_lb:
            grad_lb = (g2.t() @ h).mul_(s)
        return grad_x, grad_w, grad_bias, grad_a, grad_lb, None


def add_lora(
    linear: nn.Linear, rank: int, alpha: float, dropout: float, init_a: str = "normal"
) -> nn.Linear:
    """Turn `linear` into a LoRA linear in place (class swap + two adapter parameters)."""
    if isinstance(linear, LoRAMixin):
        raise ValueError("add_lora: this linear already has LoRA adapters")
    base_cls = type(linear)
    if base_cls not in _CLASSES:
        _CLASSES[base_cls] = type(f"LoRA{base_cls.__name__}", (LoRAMixin, base_cls), {})
    w = linear.weight
    linear.__class__ = _CLASSES[base_cls]
    kw = {"device": w.device, "dtype": torch.float32}
    linear.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, **kw))
    linear.lora_B = nn.Parameter(torch.empty(linear.out_features, rank, **kw))
    linear.lora_rank = rank
    linear.lora_scaling = alpha / rank
    linear.lora_dropout = float(dropout)
    linear.lora_init_a = init_a
    return linear


def lora_targets(model: nn.Module, cfg: LoraConfig) -> list[tuple[str, nn.Module]]:
    """(name, module) of every `layers.<i>.<path>` of `model` for `path` in cfg.module_paths:
    the modules `cfg` adapts (names as built, before any wrapper)."""
    paths = cfg.module_paths
    return [
        (name, module)
        for name, module in model.named_modules()
        if name.partition(".")[0] == "layers" and name.partition(".")[2].partition(".")[2] in paths
    ]


def add_lora_adapters(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """`add_lora` with `cfg`'s rank, alpha, dropout and init_a on every module `cfg` targets
    (lora_targets); returns their names."""
    adapted = []
    for name, module in lora_targets(model, cfg):
        if not isinstance(module, nn.Linear):
            raise TypeError(f"LoRA target {name} is a {type(module).__name__}, not a linear")
        add_lora(module, cfg.rank, cfg.alpha, cfg.dropout, cfg.init_a)
        adapted.append(name)
    return adapted


@torch.no_grad()
def merge_lora_(model: nn.Module) -> int:
    """Fold every adapter into its base weight (W += scaling * B A) and turn the module back into
    its base class, in place; on full (unsharded) tensors. Returns how many were merged."""
    merged = [m for m in model.modules() if isinstance(m, LoRAMixin)]
    for module in merged:
        module.weight.add_(module.delta_weight().to(module.weight.dtype))
        del module.lora_A, module.lora_B
        module.__class__ = type(module).__bases__[1]
    return len(merged)
