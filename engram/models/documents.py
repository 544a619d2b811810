"""Packed documents kept apart (model.attn_mask_type = "block_causal"): where each document of a
packed sequence starts, and the attention mask that lets a token see only the earlier tokens of
its own document.

A document is a run of equal `segment_ids` (the loader's: 0 at the start of a sequence, + 1
after each eos, so the eos ends its document; a padding tail may be its own document). Everything
is derived from `starts` [B, T] (the global position where each token's document starts,
computed once from the whole sequence) and the global positions a model part holds, so a rank
holding chunks of the sequence (context parallelism) or a slice of it (TP's sequence shards)
needs no boundary exchange:

    query at global position p sees key at global position j  iff  starts[p] <= j <= p
    a token's position in its document                        =   p - starts[p]

The second drives RoPE (positions restart at 0 in each document, as TRL's padding-free packing
does and as generation starts a document; RoPE scores depend only on q - k, so within a document
global positions give the same up to rounding) and the Engram ShortConv, whose tap reaching
back `o` positions is kept iff o <= the position in the document.

Kernels: SDPA with a bool mask [B, 1, Tq, Tk] (portable: CPU, CUDA, NPU; B x Tq x Tk bytes, and
SDPA turns it into an additive mask in the compute dtype that every layer saves for backward),
or FlexAttention with a block mask built from the same rule (model.attn_backend = "flex": no
T x T tensor; CUDA compiled, CPU forward only).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from engram.config.model import ATTN_BACKENDS


def document_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] int64: the position where each token's document (run of equal ids) starts."""
    if segment_ids.dim() != 2:
        raise ValueError(f"segment_ids must be [B, T], got shape {tuple(segment_ids.shape)}")
    b, t = segment_ids.shape
    pos = torch.arange(t, device=segment_ids.device).expand(b, t)
    first = torch.ones_like(segment_ids, dtype=torch.bool)
    first[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return torch.where(first, pos, 0).cummax(dim=1).values


def document_mask(
    q_pos: torch.Tensor, q_start: torch.Tensor, k_pos: torch.Tensor, backend: str
) -> torch.Tensor | BlockMask:
    """What the kernel needs to keep documents apart: queries at global positions q_pos [Tq]
    whose documents start at q_start [B, Tq], over keys at global positions k_pos [Tk].
    sdpa: bool [B, 1, Tq, Tk] (True: attend); flex: a BlockMask of the same rule."""
    if backend == "sdpa":
        k = k_pos[None, None, :]
        return ((k <= q_pos[None, :, None]) & (k >= q_start[:, :, None]))[:, None]
    if backend != "flex":
        raise ValueError(f"attention backend {backend!r} is not one of {', '.join(ATTN_BACKENDS)}")

    def keep(b, h, q, kv):
        return (k_pos[kv] <= q_pos[q]) & (k_pos[kv] >= q_start[b, q])

    b, tq, tk = q_start.shape[0], q_pos.shape[0], k_pos.shape[0]
    build = _compiled_block_mask() if q_pos.device.type == "cuda" else create_block_mask
    return build(keep, b, None, tq, tk, device=q_pos.device)


_COMPILED: dict[str, object] = {}


def _compiled_block_mask():
    """create_block_mask compiled once (as torchtitan does): eager, it evaluates the rule on the
    whole B x Tq x Tk grid, which at long sequences is the memory flex exists to avoid."""
    if "block_mask" not in _COMPILED:
        _COMPILED["block_mask"] = torch.compile(create_block_mask)
    return _COMPILED["block_mask"]


def flex_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask):
    """FlexAttention over q, k, v [B, H, T, Dh] with `mask`. CUDA: compiled once (the fused
    kernel; eager flex materialises the scores). CPU: eager, forward only (torch has no CPU
    flex backward): training on CPU takes model.attn_backend = "sdpa"."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"model.attn_backend = 'flex' runs on CUDA (and CPU, forward only), not on "
            f"{q.device.type}: set model.attn_backend = 'sdpa'"
        )
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and q.requires_grad:
            raise ValueError(
                "FlexAttention has no backward on CPU: train on CPU with "
                "model.attn_backend = 'sdpa' (flex is for CUDA)"
            )
        return flex_attention(q, k, v, block_mask=mask)
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention)
    return _COMPILED["flex"](q, k, v, block_mask=mask)
