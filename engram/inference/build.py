"""The training recipe's model for inference: one process, one device, no parallelism."""

from __future__ import annotations

import torch

from engram.config import JobConfig
from engram.data.tokenizer import Tokenizer, load_tokenizer
from engram.hashing.ngram import NgramHasher
from engram.models.builder import build_for_inference
from engram.models.transformer import Transformer


def build_for_generation(
    cfg: JobConfig,
    max_seq_len: int,
    device: torch.device | str = "cpu",
    tokenizer: Tokenizer | None = None,
) -> tuple[Transformer, Tokenizer, NgramHasher | None]:
    """The training recipe's model, unsharded on `device`, initialised with job.seed.

    `max_seq_len` sizes the RoPE table (the prompt plus the new tokens may exceed seq_len)."""
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    model, hasher = build_for_inference(cfg, tokenizer, max_seq_len, device)
    return model, tokenizer, hasher
