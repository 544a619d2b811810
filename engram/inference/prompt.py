"""A prompt's token ids, and the warning when a generation runs past the trained length."""

from __future__ import annotations

import logging

from engram.config import JobConfig
from engram.data.tokenizer import Tokenizer

logger = logging.getLogger("engram")


def encode_prompt(tokenizer: Tokenizer, prompt: str, prefix: str) -> list[int]:
    """`prefix`: eos (how our packer starts a document), bos or none, put before the prompt."""
    ids = tokenizer.encode(prompt)
    if prefix == "eos":
        return [tokenizer.eos_id, *ids]
    if prefix == "bos":
        if tokenizer.bos_id is None:
            raise ValueError(f"{tokenizer.source} has no bos token: use --prefix eos or none")
        return [tokenizer.bos_id, *ids]
    return ids


def warn_if_longer_than_trained(cfg: JobConfig, prompt_tokens: int, max_new_tokens: int) -> None:
    """Positions past training.seq_len were never trained: say so when a generation uses them."""
    total = prompt_tokens + max_new_tokens
    if total > cfg.training.seq_len:
        logger.warning(
            "the prompt (%d tokens) + max_new_tokens (%d) = %d positions exceed training.seq_len "
            "= %d: the model never saw positions past %d, and its output there is unreliable. "
            "Shorten the prompt or --max_new_tokens",
            prompt_tokens,
            max_new_tokens,
            total,
            cfg.training.seq_len,
            cfg.training.seq_len,
        )
