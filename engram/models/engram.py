"""The Engram block (DeepSeek, arXiv 2601.07372): hashed n-gram lookup -> context-aware gating
-> causal ShortConv, added to the residual stream before attention.

The math follows DeepSeek's official demo (`Engram`, `ShortConv`, `MultiHeadEmbedding`). The
block is a pure function of (hidden_states, hash_ids): hash ids are computed by the data loader
(engram/hashing/ngram.py) and already include each head's offset into the layer's concatenated table.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engram.config import Engram as EngramConfig
from engram.models import engram_stats
from engram.models.decode_cache import LayerCache
from engram.models.table_grad import embedding_lookup


def is_engram_param(name: str) -> bool:
    """Whether a parameter name (wrapper prefixes stripped) belongs to an Engram block."""
    return ".engram." in f".{name}"


def is_table_param(name: str) -> bool:
    """Whether a parameter name is an Engram block's embedding table."""
    return is_engram_param(name) and ".table." in f".{name}"


# Epsilon of the demo's key/query norms (nn.RMSNorm(eps=None) = finfo(float32).eps in fp32).
GATE_NORM_EPS = torch.finfo(torch.float32).eps
SHORT_CONV_NORM_EPS = 1e-5


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back (HF Llama/Qwen numerics)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class EngramTable(nn.Module):
    """One Engram layer's concatenated multi-head embedding table, looked up by global row id.

    parallelisms/engram_tables/ replaces this module by a row-sharded all-to-all lookup with
    the same `weight` name and forward contract; the block never looks inside.
    """

    def __init__(self, rows: int, head_dim: int, row_sparse: bool = False) -> None:
        super().__init__()
        if rows <= 0 or head_dim <= 0:
            raise ValueError(f"EngramTable needs rows > 0 and head_dim > 0, got {rows}, {head_dim}")
        self.weight = nn.Parameter(torch.empty(rows, head_dim))
        self.row_sparse = row_sparse
        """Backward leaves row-sparse gradients on `weight` (engram/models/table_grad.py), for a
        row-sparse table optimizer; the sharded lookup takes its own (apply_engram_table_sharding)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: LongTensor [..., H] -> [..., H, head_dim]."""
        return embedding_lookup(ids, self.weight, row_sparse=self.row_sparse)

    def reset_parameters(self, std: float, seed: int, key: str = "engram.table.weight") -> None:
        from engram.models.init import init_normal_

        init_normal_(self.weight, std, seed, key)

    def extra_repr(self) -> str:
        return f"rows={self.weight.shape[0]}, head_dim={self.weight.shape[1]}"


class ShortConv(nn.Module):
    """Per-branch RMSNorm, depthwise causal dilated Conv1d over time, SiLU."""

    def __init__(self, dim: int, kernel_size: int, dilation: int, hc_mult: int) -> None:
        super().__init__()
        self.hc_mult = hc_mult
        self.kernel_size = kernel_size
        self.dilation = dilation
        channels = dim * hc_mult
        self.norms = nn.ModuleList([RMSNorm(dim, eps=SHORT_CONV_NORM_EPS) for _ in range(hc_mult)])
        self.conv = nn.Conv1d(
            channels,
            channels,
            kernel_size,
            groups=channels,
            bias=False,
            padding=(kernel_size - 1) * dilation,
            dilation=dilation,
        )

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        doc_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [B, T, hc, D] -> [B, T, hc, D]. `cache.conv`: the conv input of the window before
        x (incremental decoding; None: x starts the sequence), replaced by the newest window.
        `doc_positions` [B, T]: each position's offset in its packed document; the conv then
        stops at document starts (document_conv)."""
        b, t, g, d = x.shape
        normed = torch.cat([self.norms[i](x[:, :, i, :]) for i in range(g)], dim=-1)
        normed = normed.transpose(1, 2)  # [B, channels, T]
        if doc_positions is not None:
            if cache is not None:
                raise ValueError("incremental decoding runs one document: pass no doc_positions")
            padded = F.pad(normed, (self.conv.padding[0], 0))
            y = document_conv(padded, self.conv.weight, self.dilation, doc_positions)
        elif cache is None or cache.conv is None:
            # Symmetric padding then keeping the first T outputs = causal (left) padding.
            y = self.conv(normed)[..., :t]
            if cache is not None:
                cache.conv = F.pad(normed, (self.conv.padding[0], 0))[..., t:]
        else:
            full = torch.cat([cache.conv, normed], dim=-1)  # [B, channels, window + T]
            y = F.conv1d(full, self.conv.weight, dilation=self.dilation, groups=full.shape[1])
            cache.conv = full[..., t:]
        return F.silu(y).transpose(1, 2).reshape(b, t, g, d)


def document_conv(
    padded: torch.Tensor, weight: torch.Tensor, dilation: int, doc_positions: torch.Tensor
) -> torch.Tensor:
    """The depthwise causal conv of `padded` [N, C, reach + n] (the reach positions before the n
    outputs' first, then theirs) with `weight` [C, 1, K], tap by tap: the tap reaching back
    o = (K - 1 - k) x dilation positions is dropped where o > doc_positions [N, n] (the input
    lies in an earlier document). Packed documents then get what each gets alone (as varlen
    causal convs of packed sequences do, e.g. Mamba's causal_conv1d with cu_seqlens)."""
    k_size = weight.shape[-1]
    reach = (k_size - 1) * dilation
    n = padded.shape[-1] - reach
    y = torch.zeros_like(padded[..., reach:])
    for k in range(k_size):
        back = (k_size - 1 - k) * dilation
        tap = padded[..., reach - back : reach - back + n] * weight[:, :, k]  # [N, C, n]
        y = y + (tap if back == 0 else tap * (doc_positions >= back).unsqueeze(1))
    return y


class EngramBlock(nn.Module):
    """Engram conditional memory for one decoder layer; returns the residual update."""

    def __init__(
        self, dim: int, engram_cfg: EngramConfig, table_rows: int, layer_id: int = -1
    ) -> None:
        super().__init__()
        self.dim = dim
        self.layer_id = layer_id
        """The decoder layer it sits in (the key of its log-step statistics, engram_stats.py)."""
        self.hc_mult = engram_cfg.hc_mult
        self.num_heads = engram_cfg.num_heads
        self.init_mode = engram_cfg.init
        self.table_init_std = engram_cfg.table_init_std
        engram_dim = (engram_cfg.max_ngram - 1) * engram_cfg.n_embed_per_ngram
        self.engram_dim = engram_dim
        bias = engram_cfg.use_bias
        self.table = EngramTable(table_rows, engram_cfg.head_dim)
        self.value_proj = nn.Linear(engram_dim, dim, bias=bias)
        self.key_projs = nn.ModuleList(
            [nn.Linear(engram_dim, dim, bias=bias) for _ in range(self.hc_mult)]
        )
        self.key_norms = nn.ModuleList(
            [RMSNorm(dim, eps=GATE_NORM_EPS) for _ in range(self.hc_mult)]
        )
        self.query_norms = nn.ModuleList(
            [RMSNorm(dim, eps=GATE_NORM_EPS) for _ in range(self.hc_mult)]
        )
        self.short_conv = ShortConv(
            dim, engram_cfg.kernel_size, dilation=engram_cfg.max_ngram, hc_mult=self.hc_mult
        )

    def forward(
        self,
        hidden: torch.Tensor,
        hash_ids: torch.Tensor,
        cache: LayerCache | None = None,
        doc_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: [B, T, D] (hc_mult 1) or [B, T, hc, D]; hash_ids: [B, T, H] -> like hidden.
        `cache`: the ShortConv window of earlier positions (incremental decoding).
        `doc_positions` [B, T]: each token's position in its packed document (the ShortConv
        stops at document starts; model.attn_mask_type = "block_causal")."""
        squeeze = hidden.dim() == 3
        if squeeze:
            hidden = hidden.unsqueeze(2)
        if hidden.dim() != 4 or hidden.shape[2] != self.hc_mult or hidden.shape[3] != self.dim:
            raise ValueError(
                f"EngramBlock expects hidden [B, T, {self.dim}] (hc_mult 1) or "
                f"[B, T, {self.hc_mult}, {self.dim}], got {tuple(hidden.shape)}"
            )
        if hash_ids.shape != (*hidden.shape[:2], self.num_heads):
            raise ValueError(
                f"EngramBlock expects hash_ids [B, T, {self.num_heads}] matching hidden "
                f"{tuple(hidden.shape[:2])}, got {tuple(hash_ids.shape)}"
            )
        e = self.table(hash_ids).flatten(-2).to(hidden.dtype)  # [B, T, engram_dim]
        scale = 1.0 / math.sqrt(self.dim)
        gates = []
        for m in range(self.hc_mult):
            key = self.key_norms[m](self.key_projs[m](e))
            query = self.query_norms[m](hidden[:, :, m, :])
            gate = (key * query).sum(-1) * scale
            gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
            gates.append(gate.sigmoid())
        gate = torch.stack(gates, dim=2).unsqueeze(-1)  # [B, T, hc, 1]
        value = gate * self.value_proj(e).unsqueeze(2)  # W_v shared over branches
        out = value + self.short_conv(value, cache, doc_positions)
        stats = engram_stats.sink()  # None except on log steps: no graph break then
        if stats is not None:
            stats.add(self.layer_id, gate, out, hidden)
        return out.squeeze(2) if squeeze else out

    def init_weights(self, seed: int, prefix: str, std: float = 0.02) -> None:
        """Initialise every parameter through the layout-independent init; `prefix` is this
        block's wrapper-free fully qualified name (the init key of each parameter).

        identity: value_proj (and its bias) zero, so the block returns exactly 0 and a
        pretrained backbone is unchanged at step 0. Only value_proj gets a gradient in the first
        backward (with W_v = 0, d out/d gate = 0 and d out/d e = 0, and the conv sees RMSNorm(0)
        = 0); all other parameters get gradients from the second backward on. The conv starts
        as a small normal (std 0.02) rather than zero so that its norms also get gradients from
        the second backward, and its gain on the first tiny values stays modest.
        paper: normal everywhere (linears std 0.02; conv std of PyTorch's default uniform).
        """
        from engram.models.init import init_constant_, init_normal_

        def key(name: str) -> str:
            return f"{prefix}.{name}"

        # Through `table.weight` only: a sharded replacement table needs no init method.
        init_normal_(self.table.weight, self.table_init_std, seed, key("table.weight"))
        for i, proj in enumerate(self.key_projs):
            init_normal_(proj.weight, std, seed, key(f"key_projs.{i}.weight"))
        if self.init_mode == "identity":
            init_constant_(self.value_proj.weight, 0.0)
            conv_std = 0.02
        else:
            init_normal_(self.value_proj.weight, std, seed, key("value_proj.weight"))
            conv_std = 1.0 / math.sqrt(3 * self.short_conv.kernel_size)
        init_normal_(self.short_conv.conv.weight, conv_std, seed, key("short_conv.conv.weight"))
        for lin in (self.value_proj, *self.key_projs):
            if lin.bias is not None:
                init_constant_(lin.bias, 0.0)
        for norm in (*self.key_norms, *self.query_norms, *self.short_conv.norms):
            init_constant_(norm.weight, 1.0)
