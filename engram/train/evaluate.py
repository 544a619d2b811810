"""Evaluation during training, every data.eval_every steps and at the last: the held-out loss
(data.eval_batches batches) through the same loss and, under PP, the same pipeline as the
training step; and with chat data the exact match of greedy answers to data.eval_exact_match
held-out questions (engram/inference/qa.py, run by runner/exact_match.py). Like the training loss
the held-out loss is a token mean: the sum of the target tokens' losses over all the batches of
every rank with other tokens, over their count (engram/train/loss.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from engram.config import JobConfig
from engram.train.loss import LanguageModelLoss, TargetTokens, local_value
from engram.train.step import (
    PipelineRun,
    model_inputs,
    pipeline_forward_backward,
    ranks_sum,
    to_device,
)


def eval_batches(cfg: JobConfig) -> int:
    """Loader batches per evaluation: data.eval_batches, each a global batch when
    training.global_batch_size is set (grad_accum_steps loader batches): the same held-out
    sequences at every number of ranks."""
    t = cfg.training
    return cfg.data.eval_batches * (t.grad_accum_steps if t.global_batch_size else 1)


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
    """Held-out loss: the token mean over the `num_batches` batches of every rank of `dp_group`
    (every rank holding other tokens, dp x cp). `pp`: the PipelineRun under pipeline
    parallelism (its loss is loss_fn); `prepare`: what the training step does to a batch on the
    device, e.g. the context-parallel split."""
    for part in model_parts:
        part.eval()
    loss_sum = torch.zeros((), device=device)
    labels = []
    it = iter(loader)
    for _ in range(num_batches):
        batch = to_device(next(it), device)
        if prepare is not None:
            batch = prepare(batch)
        labels.append(batch["labels"])
        if pp is not None:  # divisor 1: the sum of the token losses
            loss_sum += pipeline_forward_backward(pp, batch, 1.0, train=False)
            continue
        (model,) = model_parts
        output = model(batch["input_ids"], **model_inputs(batch))
        loss_sum += local_value(loss_fn(output, batch["labels"], 1.0))
    for part in model_parts:
        part.train()
    if pp is not None:
        pp.broadcast_loss(loss_sum)
    tokens = TargetTokens.count(labels, dp_group)  # after the forwards: no step is waiting on it
    return (ranks_sum(loss_sum, dp_group) / tokens.divisor).item()
