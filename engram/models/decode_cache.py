"""Incremental-decoding state of `Transformer.forward(..., cache=DecodeCache())`.

Per layer: the attention keys and values of every processed position (after RoPE), and for an
Engram layer the ShortConv input of the last (kernel_size - 1) x dilation positions. The hash
ids of a new position need only the last max_ngram tokens, which the caller still holds (it
hashes a short window: engram/inference/decode.py). One cache serves one batch of equally long
rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerCache:
    keys: torch.Tensor | None = None
    """[B, n_kv_heads, S, head_dim]"""
    values: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    """ShortConv input window [B, channels, (kernel_size - 1) * dilation]; None before prefill."""

    def append_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's [B, H, T, Dh] keys / values; returns all of them."""
        if self.keys is not None and self.values is not None:
            k = torch.cat([self.keys, k], dim=2)
            v = torch.cat([self.values, v], dim=2)
        self.keys, self.values = k, v
        return k, v


@dataclass
class DecodeCache:
    pos: int = 0
    """Positions already processed (the RoPE offset of the next input)."""
    layers: dict[int, LayerCache] = field(default_factory=dict)

    def layer(self, layer_id: int) -> LayerCache:
        return self.layers.setdefault(layer_id, LayerCache())
