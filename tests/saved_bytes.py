"""Bytes autograd saves for backward in one forward call: what the planner's activation model
predicts (parameters and buffers, which autograd also references, are left out)."""

from __future__ import annotations

import torch
from torch import nn


def saved_activation_bytes(model: nn.Module, *args, **kwargs) -> int:
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args, **kwargs)
    return sum(n for ptr, n in saved.items() if ptr not in held)


def check_activation_formula(cfg, convert=lambda model: None) -> None:
    """The planner's saved-activation bytes (planner/activations.py) within 2% of what autograd
    saves for `cfg`'s model on one batch of 2 x training.seq_len tokens, fp32 and bf16 (tables stay fp32, as
    the recipe keeps them). `convert(model)` runs on the built model first (LoRA, float8).
    With model.attn_mask_type = block_causal each sequence packs documents of 8 tokens."""
    from engram.data.tokenizer import load_tokenizer
    from engram.hashing.ngram import NgramHasher
    from engram.models.builder import build_model
    from planner.activations import activation_estimate

    tok = load_tokenizer("")
    hasher = NgramHasher.from_config(cfg.engram, tok, tok.vocab_size)
    t = cfg.training.seq_len
    ids = torch.randint(0, tok.vocab_size, (2, t))
    seg = (torch.arange(t) // 8).expand(2, t)
    hash_ids = torch.from_numpy(hasher(ids.numpy(), seg.numpy()))
    documents = {"segment_ids": seg} if cfg.model.attn_mask_type == "block_causal" else {}
    for dtype, dtype_name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = build_model(cfg.model, cfg.engram, tok.vocab_size, hasher.table_rows, "cpu")
        convert(model)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)  # values do not matter, but no denormals (slow matmuls)
        model.to(dtype)
        for block in model.engram_blocks().values():
            block.table.float()
        measured = saved_activation_bytes(model, ids, hash_ids=hash_ids, **documents)
        predicted = activation_estimate(cfg, model.args, dtype_name).saved_bytes
        assert abs(predicted - measured) / measured < 0.02, (dtype, predicted, measured)
