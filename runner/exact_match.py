"""The training loop's exact-match evaluation (data.eval_exact_match; engram/inference/qa.py says
what is asked, how the ranks decode together and how answers are normalised)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from engram.config import JobConfig
from engram.data.tokenizer import Tokenizer
from engram.hashing.ngram import NgramHasher
from engram.inference.qa import Asker, ExactMatch, exact_match, questions


class ExactMatchEval:
    """The first data.eval_exact_match questions of the held-out split, read at start (a data
    problem stops the run then, not at the first evaluation), answered at every evaluation."""

    def __init__(self, cfg: JobConfig, tokenizer: Tokenizer, hasher: NgramHasher | None) -> None:
        self.items = questions(cfg, tokenizer, "val", cfg.data.eval_exact_match)
        self.asker = Asker(cfg, tokenizer)
        self.hasher, self.max_new_tokens = hasher, cfg.data.eval_max_new_tokens

    def __call__(self, model_parts: list[nn.Module], group: dist.ProcessGroup) -> ExactMatch:
        """Every rank of `group` (all ranks: no TP / PP / CP, the config refuses them) answers
        its share with its whole model (FSDP gathers it per forward)."""
        (model,) = model_parts
        together = group if dist.get_world_size(group) > 1 else None
        model.eval()
        try:
            return exact_match(
                model, self.hasher, self.asker, self.items, self.max_new_tokens, together
            )
        finally:
            model.train()


def build_exact_match(
    cfg: JobConfig, tokenizer: Tokenizer, hasher: NgramHasher | None
) -> ExactMatchEval | None:
    """The loop's exact-match evaluation, or None without data.eval_exact_match."""
    return ExactMatchEval(cfg, tokenizer, hasher) if cfg.data.eval_exact_match else None
