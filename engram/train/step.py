"""One optimizer step's pieces: forward-backward of a micro-batch (whole model, or this rank's
pipeline stages through their schedule), the sum of a logged loss share over the ranks with other
tokens, and the update (or the guard's skip) with the learning-rate schedules.

Every loss here is a share of the step's token mean: the micro-batch's token-loss sum over the
step's one count of target tokens (engram/train/loss.py TargetTokens), so shares add up, over
micro-batches, pipeline micro-batches and ranks.

runner/step.py's TrainStep calls these in order (the one step of the recipes, check_cluster and
the benchmarks: forward / backward, clip, guard, update); what an engine does differently
(DeepSpeed's `engine.backward` / `engine.step`) is runner/engine_step.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from engram.train.loss import LanguageModelLoss, local_value


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def next_batches(
    data_iter: Iterator[dict[str, torch.Tensor]], n: int, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """This step's `n` micro-batches, on the device, read up front (host tables prefetch their
    rows from all of them before the first forward)."""
    return [to_device(next(data_iter), device) for _ in range(n)]


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's keyword inputs from a batch: hash ids, the global positions of a context
    parallel split (parallelisms/context_parallel.py split_batch) and the segment ids of the
    whole sequence (read by a model with model.attn_mask_type = "block_causal"). By keyword so
    a pipeline schedule forwards them to every stage (split along dim 0 like the batch)."""
    return {k: batch[k] for k in ("hash_ids", "positions", "segment_ids") if k in batch}


def forward_backward(
    model_parts: list[nn.Module],
    batch: dict[str, torch.Tensor],
    loss_fn: LanguageModelLoss,
    divisor: torch.Tensor,
) -> torch.Tensor:
    """One micro-batch: forward, loss (its token-loss sum / `divisor`, the step's
    TargetTokens.divisor), backward; returns the detached loss. Hash ids and positions go by
    keyword (model_inputs)."""
    (model,) = model_parts  # pp = 1: one part
    output = model(batch["input_ids"], **model_inputs(batch))
    loss = loss_fn(output, batch["labels"], divisor)
    loss.backward()
    return local_value(loss)


class PipelineLoss:
    """The last stage's loss per pipeline micro-batch: its token-loss sum / `divisor` (the
    step's TargetTokens.divisor, set before each schedule step). torch does not rescale pipeline
    gradients (scale_grads=False), so the schedule's micro-batches add up like any others."""

    def __init__(self, loss_fn: LanguageModelLoss) -> None:
        self.loss_fn = loss_fn
        self.divisor: torch.Tensor | float = 1.0

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, labels, self.divisor)


@dataclass
class PipelineRun:
    """This rank's pipeline schedules and where the loss lives (under PP only; built by
    runner/model_parts.py)."""

    schedule: Any  # a torch.distributed.pipelining schedule over this rank's stages
    eval_schedule: Any  # forward-only (see parallelisms/pipeline.py build_eval_schedule)
    microbatches: int  # per schedule step
    loss: PipelineLoss
    has_first_stage: bool  # feeds input_ids
    group: dist.ProcessGroup  # the pp group
    last_stage_rank: int  # global rank holding the last stage (it computes the loss)

    def broadcast_loss(self, value: torch.Tensor) -> None:
        dist.broadcast(value, src=self.last_stage_rank, group=self.group)


def pipeline_forward_backward(
    pp: PipelineRun,
    batch: dict[str, torch.Tensor],
    divisor: torch.Tensor | float,
    train: bool = True,
) -> torch.Tensor:
    """One local batch through the pipeline schedule (split into micro-batches by torch), each
    pipeline micro-batch's loss its token-loss sum / `divisor`. Returns the sum of those losses
    on the rank holding the last stage, 0 elsewhere. Hash ids go by keyword: torch splits them
    along dim 0 and gives every stage its slice."""
    schedule = pp.schedule if train else pp.eval_schedule
    pp.loss.divisor = divisor
    args = (batch["input_ids"],) if pp.has_first_stage else ()
    kwargs = model_inputs(batch)
    losses: list[torch.Tensor] = []
    run = schedule.step if train else schedule.eval
    run(*args, target=batch["labels"], losses=losses, **kwargs)
    if not losses:
        return torch.zeros((), device=batch["labels"].device)
    return sum(local_value(x) for x in losses)


def ranks_sum(value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of a per-rank value over `group` (the ranks with other tokens: a loss's shares), on
    the device (no host read)."""
    value = value.detach().float().clone()
    dist.all_reduce(value, group=group)
    return value


def step_optimizers(
    optimizers: list[torch.optim.Optimizer], schedulers: list[LambdaLR], skip: bool
) -> None:
    """The update, or none on a step the non-finite guard skips; the gradients are cleared and
    the schedules advance either way (a skipped step still counts as a step)."""
    for opt in optimizers:
        if not skip:
            opt.step()
        opt.zero_grad(set_to_none=True)
    for sched in schedulers:
        sched.step()
