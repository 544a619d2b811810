"""The held-out loss (engram/train/evaluate.py) is the token mean over every evaluation batch of
every rank: what the training loss is per step, and what "loss on the target tokens of the
held-out conversations" means when their target counts differ (prompt-masked chat data)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launcher import run_distributed

from engram.config import config_from_dict
from engram.inference import build_for_generation
from engram.train.evaluate import evaluate
from engram.train.loss import LanguageModelLoss

TARGETS = {0: (3, 5), 1: (30, 41)}  # rank -> target tokens of its two batches: very unequal


def _batches(rank: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for n in TARGETS[rank]:
        ids = torch.randint(0, vocab, (2, 32), generator=g)
        labels = torch.full_like(ids, -100)
        keep = torch.randperm(ids.numel(), generator=g)[:n]
        labels.view(-1)[keep] = torch.randint(0, vocab, (n,), generator=g)
        out.append({"input_ids": ids, "labels": labels})
    return out


def _held_out_loss(rank: int, world: int) -> tuple[float, float, int]:
    cfg = config_from_dict({"job": {"device": "cpu", "seed": 3}, "engram": {"enabled": False}})
    model, tok, _ = build_for_generation(cfg, 32)
    batches = _batches(rank, tok.vocab_size)
    loss_fn = LanguageModelLoss(1, None, False)
    got = evaluate([model], batches, 2, torch.device("cpu"), dist.group.WORLD, loss_fn)
    with torch.no_grad():  # this rank's sum of target-token losses and their count, by hand
        total = sum(
            F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(),
                            ignore_index=-100, reduction="sum").item()
            for b in batches
        )  # fmt: skip
    return got, total, sum(TARGETS[rank])


def test_held_out_loss_is_the_token_mean_of_every_batch_of_every_rank():
    results = run_distributed(_held_out_loss, 2)
    token_mean = sum(r[1] for r in results) / sum(r[2] for r in results)
    for got, _, _ in results:
        assert got == pytest.approx(token_mean, rel=1e-6)
