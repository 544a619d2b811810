"""The one training step: what recipes/train.py, the trial step (check_cluster's `real_step`,
benchmarks/bench_mfu.py) and, with the engine's pieces, recipes/train_deepspeed.py run.

`TrainStep` is built once from this rank's model parts, loss, pipeline run, optimizers and
schedules; a call takes the step's micro-batches as the loader gave them (whole samples, on the
device) and runs, in this order:

    the context-parallel cut (split_batch: this rank's chunks; the whole batch at cp = 1)
    the step's count of target tokens (TargetTokens.count: one all-reduce over dp x cp, before
        any backward; every micro-batch's loss is its token sum / that count)
    host-table prefetch (the rows of every lookup of the step, before the first forward:
        under TP each rank's sequence piece, under PP its stages' tables per schedule
        micro-batch, parallelisms/table_prefetch.py); then, with the next step's
        micro-batches read ahead (`ahead`), NVMe tables start paging their rows in
    forward / backward per micro-batch (under PP: one schedule step each), gradient accumulation
    clip (one global norm), the logged loss: the sum of the ranks' shares (the step's token mean)
    the non-finite guard (before any update), the update or its skip, the schedules

and returns the logged loss, the gradient norm, whether the guard skipped the update, the
learning rate the update used and the step's target tokens. On log steps its telemetry
(engram/train/telemetry.py) records the Engram blocks' gate statistics during forward / backward
and the table update's touched rows and size; the run's Progress reads them with the loss. The
pieces it calls (TargetTokens.count, forward_backward, the PP schedule, ranks_sum,
step_optimizers) are engram/train/'s; the order and the layout's rules are here, once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from engram.config import JobConfig
from engram.optim.builder import clip_grad_norm_, scheduled_lr
from engram.train.evaluate import evaluate
from engram.train.loss import LanguageModelLoss, TargetTokens
from engram.train.nonfinite import NonFiniteGuard
from engram.train.step import (
    PipelineRun,
    forward_backward,
    pipeline_forward_backward,
    ranks_sum,
    step_optimizers,
)
from engram.train.telemetry import StepTelemetry
from parallelisms.context_parallel import split_batch
from parallelisms.fsdp import defer_grad_sync
from parallelisms.parallel_dims import ParallelDims
from parallelisms.table_prefetch import page_in_nvme_tables, prefetch_host_tables

Batch = dict[str, torch.Tensor]


@dataclass
class StepResult:
    loss: torch.Tensor  # the step's token mean over every rank's targets (dp x cp), on the device
    grad_norm: torch.Tensor  # the global norm before clipping, float32, on the device
    skip: bool  # the non-finite guard skipped the update
    lr: float  # the learning rate this update used (scheduled_lr, read before the schedules step)
    target_tokens: torch.Tensor  # the step's target tokens over every rank (int64, on the device)


class TrainStep:
    """One optimizer step over this rank's model parts (see the module docstring). Subclasses
    replace the engine's parts (forward_backward, clip, update), never the order."""

    prefetches_tables = True
    """Whether host / NVMe table rows are prefetched (when the run has such tables): a subclass
    whose engine cannot hold them sets False."""

    def __init__(
        self,
        cfg: JobConfig,
        dims: ParallelDims,
        model_parts: list[nn.Module],
        loss_fn: LanguageModelLoss,
        optimizers: list[torch.optim.Optimizer],
        schedulers: list[LambdaLR],
        pp: PipelineRun | None = None,
        guard: NonFiniteGuard | None = None,
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.cfg, self.dims = cfg, dims
        self.model_parts, self.loss_fn, self.pp = model_parts, loss_fn, pp
        self.optimizers, self.schedulers, self.guard = optimizers, schedulers, guard
        self.accum = cfg.training.grad_accum_steps
        # Every rank with other tokens (dp x cp): they count the step's targets together, and
        # the logged loss is the sum of their shares.
        self.dp_group = dp_group or dims.mesh("dp_cp").get_group()
        self.trainable = [p for part in model_parts for p in part.parameters() if p.requires_grad]
        self.pp_group = dims.mesh("pp").get_group() if dims.pp_enabled else None
        # Host / NVMe tables: every lookup's rows are prefetched, under any layout
        # (parallelisms/table_prefetch.py says which ids each lookup sees).
        self.prefetch = (
            self.prefetches_tables and cfg.engram.enabled and cfg.engram.table_location != "device"
        )
        self.pieces = self.pp.microbatches if self.pp is not None else 1  # per batch, under PP
        self.telemetry = StepTelemetry(cfg, model_parts, optimizers)

    def __call__(
        self, batches: list[Batch], step: int, ahead: list[Batch] | None = None
    ) -> StepResult:
        """One optimizer step on this step's micro-batches (whole samples, on the device);
        `ahead`: the next step's, if the loop read them ahead."""
        batches = [self.cut(batch) for batch in batches]
        tokens = TargetTokens.count([b["labels"] for b in batches], self.dp_group)
        if self.prefetch:  # behind the previous step's host update (engram_tables/host.py)
            prefetch_host_tables(self.model_parts, [b["hash_ids"] for b in batches], self.pieces)
        if self.prefetch and ahead:  # after this step's prefetches: they are queued first
            ahead_ids = [self.cut(batch)["hash_ids"] for batch in ahead]
            page_in_nvme_tables(self.model_parts, ahead_ids, self.pieces)
        with self.telemetry.recording(step):  # gate statistics, on log steps
            loss_share = self.forward_backward(batches, tokens)
        grad_norm = self.clip()
        loss = ranks_sum(loss_share, self.dp_group)
        grad_norm = grad_norm.detach().float().to(loss.device)
        skip = self.guard.skip(step, torch.stack([loss, grad_norm])) if self.guard else False
        lr = scheduled_lr(self.schedulers[0], self.cfg.optimizer.lr) if self.schedulers else 0.0
        with self.telemetry.update(step, skip):  # rows touched, update size, on log steps
            self.update(skip)
        return StepResult(loss, grad_norm, skip, lr, tokens.total)

    def cut(self, batch: Batch) -> Batch:
        """This rank's part of a batch: its context-parallel chunks (whole at cp = 1)."""
        return split_batch(batch, self.dims)

    def forward_backward(self, batches: list[Batch], tokens: TargetTokens) -> torch.Tensor:
        """Gradients of the step's token mean over this rank's micro-batches (each loss its token
        sum / the step's count); returns this rank's share of that mean (the sum of their
        losses)."""
        device = batches[0]["labels"].device
        loss_share = torch.zeros((), device=device)
        for micro, batch in enumerate(batches):
            if self.pp is not None:  # the schedule toggles FSDP's reduction itself
                loss_share += pipeline_forward_backward(self.pp, batch, tokens.divisor)
                continue
            # DDP reduces once per optimizer step; FSDP/HSDP every micro-batch (see fsdp.py).
            if defer_grad_sync(self.dims):
                for part in self.model_parts:
                    part.set_requires_gradient_sync(micro == len(batches) - 1)
            loss_share += forward_backward(self.model_parts, batch, self.loss_fn, tokens.divisor)
        if self.pp is not None:  # the loss lives on the last stage
            self.pp.broadcast_loss(loss_share)
        return loss_share

    def clip(self) -> torch.Tensor:
        return clip_grad_norm_(self.trainable, self.cfg.training.max_norm, pp_group=self.pp_group)

    def update(self, skip: bool) -> None:
        step_optimizers(self.optimizers, self.schedulers, skip)

    def evaluate(self, loader: Iterable[Batch], num_batches: int, device: torch.device) -> float:
        """Held-out loss through the same cut, loss and (under PP) pipeline as the step."""
        return evaluate(
            self.model_parts, loader, num_batches, device, self.dp_group, self.loss_fn, self.pp,
            prepare=self.cut,
        )  # fmt: skip
