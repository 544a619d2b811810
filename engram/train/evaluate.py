"""Evaluation during training, every data.eval_every steps and at the last: the held-out loss
(data.eval_batches batches) through the same loss and, under PP, the same pipeline as the
training step; and with chat data the exact match of greedy answers to data.eval_exact_match
held-out questions (engram/inference/qa.py, run by runner/exact_match.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from engram.config import JobConfig
from engram.train.loss import LanguageModelLoss, local_value
from engram.train.step import (
    PipelineRun,
    dp_mean,
    model_inputs,
    pipeline_forward_backward,
    to_device,
)


def eval_due(cfg: JobConfig, step: int) -> bool:
    d = cfg.data
    if d.eval_batches <= 0 and d.eval_exact_match <= 0:
        return False
    return bool(d.eval_every and step % d.eval_every == 0) or step == cfg.training.steps


@torch.no_grad()
def evaluate(
    model_parts: list[nn.Module],
    loader,
    num_batches: int,
    device: torch.device,
    dp_group: dist.ProcessGroup,
    loss_fn: LanguageModelLoss,
    pp: PipelineRun | None = None,
    prepare: Callable[[dict], dict] | None = None,
) -> float:
    """Held-out loss (`pp`: the PipelineRun under pipeline parallelism; its loss is loss_fn;
    `prepare`: what the training step does to a batch on the device, e.g. the context-parallel
    split; `dp_group`: every rank holding other tokens, dp x cp)."""
    for part in model_parts:
        part.eval()
    total = torch.zeros((), device=device)
    it = iter(loader)
    for _ in range(num_batches):
        batch = to_device(next(it), device)
        if prepare is not None:
            batch = prepare(batch)
        if pp is not None:
            total += pipeline_forward_backward(pp, batch, 1.0, train=False)
            continue
        (model,) = model_parts
        output = model(batch["input_ids"], **model_inputs(batch))
        total += local_value(loss_fn(output, batch["labels"]))
    for part in model_parts:
        part.train()
    if pp is not None:
        pp.broadcast_loss(total)
    return dp_mean(total / num_batches, dp_group).item()
