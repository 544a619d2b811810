"""Optimizers, learning-rate schedules and global gradient clipping.

Parameter groups (the paper's and Megatron's defaults):
  backbone       AdamW(lr, weight_decay) - matrices decay, 1-D params (norms, biases) do not
  engram dense   AdamW(lr * engram_lr_mult) - projections, norms, ShortConv
  engram tables  optimizer.table_optimizer (adam | lazy_adam | rowwise_adagrad) at
                 lr * table_lr_mult, weight_decay = table_weight_decay = 0. Tables live in their own optimizer because they are DTensors on
                 the "engram" mesh while FSDP parameters live on the data-parallel shard mesh, and
                 foreach kernels must not mix meshes.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from engram.config import JobConfig
from engram.config.table_locations import table_location_error
from engram.config.table_optimizers import table_optimizer_spec
from engram.models.engram import is_engram_param, is_table_param
from engram.models.lora import is_lora_param
from engram.models.table_grad import row_grad_norm_sq, scale_row_grads_
from engram.rowstore.host_worker import table_location_of
from engram.runtime.distributed import shard_groups


def is_trainable(name: str, mode: str) -> bool:
    """Whether parameter `name` trains in training.mode `mode` (the one statement of the rule):
    full trains everything, engram_only the Engram parameters, lora those and the adapters."""
    return mode == "full" or is_engram_param(name) or (mode == "lora" and is_lora_param(name))


def saved_params(cfg: JobConfig) -> Callable[[str], bool] | None:
    """What a checkpoint holds of the model: everything (None), or with checkpoint.trainable_only
    the parameters training.mode trains (the frozen backbone comes from the HF folder / seed)."""
    if not cfg.checkpoint.trainable_only:
        return None
    return functools.partial(is_trainable, mode=cfg.training.mode)


def apply_training_mode(model: nn.Module, mode: str) -> None:
    """Set requires_grad of every parameter by `is_trainable`."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_trainable(name, mode))


def build_optimizers(model: nn.Module, cfg: JobConfig) -> list[torch.optim.Optimizer]:
    o = cfg.optimizer
    betas = (o.betas[0], o.betas[1])
    backbone_decay, backbone_no_decay, engram_decay, engram_no_decay, tables = [], [], [], [], []
    for name, p in model.named_parameters():  # module order: identical on every rank
        if not p.requires_grad:
            continue
        ndim = len(getattr(p, "ds_shape", p.shape))  # DeepSpeed ZeRO-3 keeps it in ds_shape
        if is_table_param(name):
            tables.append(p)
        elif is_engram_param(name):
            (engram_decay if ndim >= 2 else engram_no_decay).append(p)
        else:
            (backbone_decay if ndim >= 2 else backbone_no_decay).append(p)
    groups = [
        {"params": backbone_decay, "lr": o.lr, "weight_decay": o.weight_decay, "name": "backbone"},
        {"params": backbone_no_decay, "lr": o.lr, "weight_decay": 0.0, "name": "backbone_no_decay"},
        {
            "params": engram_decay,
            "lr": o.lr * o.engram_lr_mult,
            "weight_decay": o.weight_decay,
            "name": "engram",
        },
        {
            "params": engram_no_decay,
            "lr": o.lr * o.engram_lr_mult,
            "weight_decay": 0.0,
            "name": "engram_no_decay",
        },
    ]
    groups = [g for g in groups if g["params"]]
    optimizers: list[torch.optim.Optimizer] = []
    if groups:
        params = [p for g in groups for p in g["params"]]
        fused = _fused_adam_ok(params) or None
        optimizers.append(torch.optim.AdamW(groups, lr=o.lr, betas=betas, eps=o.eps, fused=fused))
    if tables:
        table_lr = o.lr * o.table_lr_mult
        table_group = [
            {
                "params": tables,
                "lr": table_lr,
                "weight_decay": o.table_weight_decay,
                "name": "engram_tables",
            }
        ]
        optimizers.append(build_table_optimizer(o.table_optimizer, table_group, betas, o.eps))
    if not optimizers:
        raise ValueError("no trainable parameters: check training.mode and engram.enabled")
    return optimizers


def build_table_optimizer(
    name: str, groups: list[dict], betas: tuple[float, float], eps: float
) -> torch.optim.Optimizer:
    """The tables' optimizer (optimizer.table_optimizer, engram/config/table_optimizers.py); lr /
    weight_decay come from `groups`.

    A row-sparse optimizer (lazy_adam, rowwise_adagrad) reads the (rows, row grads) that the
    lookups of tables sharded with `row_sparse=True` leave on the parameters, or the touched rows
    of a dense `.grad` otherwise (engram/models/table_grad.py).
    """
    spec = table_optimizer_spec(name)
    kwargs = {"eps": eps, **({"betas": betas} if spec.takes_betas else {})}
    if not spec.row_sparse:
        locations = {table_location_of(p) for g in groups for p in g["params"]}
        errors = [table_location_error(loc, name) for loc in sorted(locations)]
        if any(errors):
            raise ValueError(next(e for e in errors if e))
        # AdamW with weight_decay 0 is exactly Adam; decoupled decay if table_weight_decay > 0.
        # Fused where torch has the kernel: one pass over each table instead of ~10 (the default
        # on CPU is the per-op loop: 7x slower on a 400k x 32 table).
        params = [p for g in groups for p in g["params"]]
        kwargs["fused"] = _fused_adam_ok(params) or None
    module, cls = spec.class_path.split(":")  # imported here: config names it, optim owns it
    return getattr(importlib.import_module(module), cls)(groups, **kwargs)


def _fused_adam_ok(params: list[torch.Tensor]) -> bool:
    """torch's fused AdamW runs on these params: float, on CPU or CUDA (other backends keep the
    default implementation), and either no DTensor or all DTensors on one mesh (one fused call
    must not mix meshes)."""
    dtensors = [p for p in params if isinstance(p, DTensor)]
    if dtensors and (
        len(dtensors) != len(params) or len({id(p.device_mesh) for p in dtensors}) > 1
    ):
        return False
    locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return bool(locals_) and all(
        t.device.type in ("cpu", "cuda") and t.is_floating_point() for t in locals_
    )


def lr_lambda(
    step: int, warmup_steps: int, total_steps: int, decay_type: str, min_lr_ratio: float
) -> float:
    """Multiplier on the peak lr for optimizer step `step` (0-based; the recipe's step s is s-1).

    warmup (step < W):  (step + 1) / (W + 1)           first step lr / (W + 1), never 0
    decay (step >= W):  r + (1 - r) * f(p),  p = min(1, (step - W) / (T - W - 1))
                        f = 1 - p (linear), (1 + cos(pi p)) / 2 (cosine), 1 (constant)
    with W = warmup_steps, T = total_steps, r = min_lr_ratio: the first step after warmup runs at
    the peak lr and the last step (T - 1) at r x peak. With a single step after warmup
    (T - W = 1) that step runs at the peak lr."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay_type == "constant":
        return 1.0
    decay_steps = total_steps - warmup_steps - 1
    progress = min(1.0, (step - warmup_steps) / decay_steps) if decay_steps > 0 else 0.0
    if decay_type == "linear":
        frac = 1.0 - progress
    else:
        frac = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * frac


def build_lr_schedulers(optimizers: list[torch.optim.Optimizer], cfg: JobConfig) -> list[LambdaLR]:
    s = cfg.lr_scheduler
    fn = functools.partial(
        lr_lambda,
        warmup_steps=s.warmup_steps,
        total_steps=cfg.training.steps,
        decay_type=s.decay_type,
        min_lr_ratio=s.min_lr_ratio,
    )
    return [LambdaLR(opt, fn) for opt in optimizers]


def scheduled_lr(scheduler: LambdaLR, base_lr: float) -> float:
    """`base_lr` (optimizer.lr) scaled by the schedule at the scheduler's current step: the lr
    the next update uses, and the logged "lr" metric. The same in every training mode and on
    every pipeline stage (param group 0 is the Engram group in engram_only mode); each group's
    own lr is this times its multiplier (engram_lr_mult, table_lr_mult)."""
    return base_lr * scheduler.lr_lambdas[0](scheduler.last_epoch)


class SchedulersState:
    """Stateful view over the lr schedulers (one per optimizer, stepped together), saved as the
    step count alone (an int64 tensor: nothing pickled). Every schedule is a function of the
    step and of the config's peak lr (lr_lambda), so a resume follows the config's schedule,
    at any layout, including pipeline stages whose optimizers hold other param groups."""

    def __init__(self, schedulers: list[LambdaLR]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"last_epoch": torch.tensor(self.schedulers[0].last_epoch, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for s in self.schedulers:
            s.last_epoch = int(state["last_epoch"])
            lrs = [b * f(s.last_epoch) for b, f in zip(s.base_lrs, s.lr_lambdas, strict=True)]
            for group, lr in zip(s.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            s._last_lr = lrs


@torch.no_grad()
def align_grads_(params: list[nn.Parameter]) -> None:
    """Bring DTensor gradients to their parameter's placements.

    Under TP, DTensor leaves the gradient of a replicated parameter that saw sharded activations
    (sequence-parallel norms) as Partial (a pending sum over TP), and that of the vocabulary-
    parallel embedding as Replicate; the norm and the optimizer need them in the parameter's
    layout. FSDP-managed gradients already are.
    """
    for p in params:
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Global L2 grad norm over every parameter, each element counted exactly once; clip if
    max_norm > 0. Collective over every group a gradient is sharded on.

    Works across meshes (FSDP / HSDP shards, TP shards incl. FSDP's _StridedShard over TP,
    Engram tables on the engram axis): gradients are first brought to their parameter's
    placements (align_grads_); the squared local norms are summed per set of shard groups,
    all-reduced over those groups only (Replicate dims are counted once), then added up.
    `pp_group`: under pipeline parallelism each stage holds other parameters; their squared
    norms are summed over the stages too (every stage must call this, even one without grads).
    """
    params = list(params)
    dense = [p for p in params if p.grad is not None]
    align_grads_(dense)
    grads = [p.grad for p in dense]
    buckets = row_grad_norm_sq(params)  # row-sparse table grads (engram/models/table_grad.py)
    if not grads and not buckets and pp_group is None:
        return torch.zeros(())
    for g in grads:
        key = shard_groups(g)
        local = g.to_local() if isinstance(g, DTensor) else g
        sq = local.detach().float().pow(2).sum()
        buckets[key] = buckets[key] + sq if key in buckets else sq
    if buckets:
        device = next(iter(buckets.values())).device
    else:  # a pipeline stage without gradients still joins the pp reduction
        device = params[0].device if params else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for groups, sq in buckets.items():
        for group in groups:
            dist.all_reduce(sq, group=group)
        total_sq = total_sq + sq.to(total_sq.device)
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.device))
        scale_row_grads_(params, coef)
    return total
