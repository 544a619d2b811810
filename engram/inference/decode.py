"""The decode loop: token by token against a KV cache, with the Engram hash ids of each new position.

The prompt runs once, then each step runs only the newest token (engram/models/decode_cache.py
keeps the keys / values per layer and the ShortConv window per Engram layer). Engram needs the
hash ids of the new position, which depend on the last max_ngram tokens: they are hashed on the
model's device (`NgramHasher.hash_torch`). `use_cache=False` recomputes the whole sequence every
step instead (O(T^2); the reference the cached path is tested against).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from engram.hashing.ngram import NgramHasher
from engram.inference.sampling import sample_next
from engram.models.decode_cache import DecodeCache
from engram.models.transformer import Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    input_ids: torch.Tensor,
    hasher: NgramHasher | None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    use_cache: bool = True,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """input_ids [B, T] (or [T]) -> [B, T + n] with n <= max_new_tokens new tokens.

    With `use_cache` the prompt runs once and each step runs the newest token against the KV
    cache; else each step runs the full sequence. Hash ids are computed on the model's device
    (for the newest positions: from the last max_ngram tokens only). Stops early once every
    row has produced `eos_id`; finished rows are padded with it. `vocab_size` (the tokenizer's):
    output rows past it (padding, e.g. Qwen2.5's 152,064 rows for 151,665 tokens) are never
    chosen, so every id can be decoded and hashed."""
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    device = model.rope_cache.device
    ids = ids.to(device=device, dtype=torch.long)
    if ids.shape[1] + max_new_tokens > model.args.max_seq_len:
        raise ValueError(
            f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's max_seq_len {model.args.max_seq_len}: build it with a larger max_seq_len"
        )
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token (or use --prefix eos)")
    if vocab_size is not None and not 0 < vocab_size <= model.args.vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} must be in 1..{model.args.vocab_size} (the output rows)"
        )
    stops = None
    if eos_id is not None:
        stops = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), device=device)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    cache = DecodeCache() if use_cache else None
    for _ in range(max_new_tokens):
        start = 0 if cache is None else cache.pos
        hash_ids = None
        if hasher is not None:  # position t hashes tokens t - max_ngram + 1 .. t
            window = ids[:, max(0, start - hasher.max_ngram + 1) :]
            hash_ids = hasher.hash_torch(window)[:, start - ids.shape[1] :].to(device)
        logits = model(ids[:, start:], hash_ids=hash_ids, cache=cache, last_positions=1)[:, -1]
        if vocab_size is not None:
            logits[:, vocab_size:] = float("-inf")
        nxt = sample_next(logits, temperature, top_k, generator)
        if stops is not None:
            nxt = torch.where(done, stops[0], nxt)
            done |= torch.isin(nxt, stops)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if stops is not None and _all_done(done, group):
            break
    return ids


def _all_done(done: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Every row finished, on every rank of `group` (one all-reduce of a count)."""
    if group is None:
        return bool(done.all())
    left = (~done).sum().to(torch.int64)
    dist.all_reduce(left, group=group)
    return int(left) == 0
