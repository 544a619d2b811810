"""Engram conditional memory (DeepSeek, arXiv 2601.07372) on a Llama-3 / Qwen2 / Qwen3 backbone.

Written beside config.json by engram-titan's scripts/export_hf.py; needs only torch and
transformers >= 5 (tested with 5.24). Load it with

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

The backbone is transformers' own LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM. An
Engram block sits in `model.layers[i].engram` for every i in config.engram["layer_ids"] and adds
its output to the residual stream before that layer's attention (a forward pre-hook). Hash ids
are computed in torch from input_ids, bit-exact with the training data loader: compressed ids
(the `engram_hash.lookup` table saved with the weights), XOR of id x odd multiplier over each
n-gram window, left-padded with the compressed pad id, modulo a distinct prime per (layer, n,
head), plus the head's offset into the layer's concatenated table.
The multipliers and primes are derived here from config.engram's seed and sizes (config.json
stores them for reading only; a stored value that disagrees is refused, naming the key).

Incremental decoding: the hash ids of position t depend on the last max_ngram tokens, the
ShortConv on the last (kernel_size - 1) x dilation positions. Both windows live in the KV cache:
each Engram layer's cache layer is transformers' LinearAttentionAndFullAttentionLayer (KV plus
conv states: state 0 the ShortConv input window, state 1 the previous max_ngram - 1 compressed
ids), so beam search reorders them with the keys and values. Positions whose attention_mask is 0
(left padding) count as the pad id for hashing and as zeros for the ShortConv, as if the row
started after them.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
)

GATE_NORM_EPS = torch.finfo(torch.float32).eps  # the demo's nn.RMSNorm(eps=None) in fp32
SHORT_CONV_NORM_EPS = 1e-5
CONV_STATE, TOKEN_STATE = 0, 1  # conv-state slots of an Engram layer's cache layer


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back (HF Llama/Qwen numerics)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# --- hashing constants, derived from config.engram's seed and sizes -------------------------------
# A transcription of engram-titan's engram/hashing/ngram.py (layer_multipliers: numpy's
# default_rng(seed + 10007 * layer).integers(0, bound, n, int64) * 2 + 1; find_table_primes), in
# plain Python so this file needs no numpy: SeedSequence -> PCG64 -> Lemire's bounded integers.
_M32, _M64, _M128 = 2**32 - 1, 2**64 - 1, 2**128 - 1
_PCG_MULT = (2549297995355413924 << 64) + 4865540595714422341
_INT64_MAX = 2**63 - 1


def _hashmix(value: int, const: list[int]) -> int:
    value ^= const[0]
    const[0] = (const[0] * 0x931E8875) & _M32
    value = (value * const[0]) & _M32
    return value ^ (value >> 16)


def _mix(x: int, y: int) -> int:
    r = (0xCA01F9DD * x - 0x4973F715 * y) & _M32
    return r ^ (r >> 16)


def _seed_sequence_state(seed: int, words: int) -> list[int]:
    """numpy.random.SeedSequence(seed).generate_state(words, uint32) (pool size 4)."""
    entropy = []
    while True:
        entropy.append(seed & _M32)
        seed >>= 32
        if not seed:
            break
    const = [0x43B0D7E5]
    pool = [_hashmix(entropy[i] if i < len(entropy) else 0, const) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = _mix(pool[dst], _hashmix(pool[src], const))
    for src in range(4, len(entropy)):
        for dst in range(4):
            pool[dst] = _mix(pool[dst], _hashmix(entropy[src], const))
    out, const_b = [], 0x8B51F9DD
    for i in range(words):
        v = pool[i % 4] ^ const_b
        const_b = (const_b * 0x58F38DED) & _M32
        v = (v * const_b) & _M32
        out.append(v ^ (v >> 16))
    return out


class _PCG64:
    """numpy's PCG64 (XSL-RR 128/64) seeded as default_rng(seed) seeds it."""

    def __init__(self, seed: int) -> None:
        w = _seed_sequence_state(seed, 8)
        s = [w[2 * i] | (w[2 * i + 1] << 32) for i in range(4)]  # uint32 pairs -> uint64
        init, inc = (s[0] << 64) | s[1], (s[2] << 64) | s[3]
        self.inc = ((inc << 1) | 1) & _M128
        self.state = (self.inc + init) & _M128  # step from 0, add the seed ...
        self.state = (self.state * _PCG_MULT + self.inc) & _M128  # ... and step again
        self.buf, self.bcnt = 0, 0

    def next64(self) -> int:
        self.state = (self.state * _PCG_MULT + self.inc) & _M128
        x, rot = ((self.state >> 64) ^ self.state) & _M64, self.state >> 122
        return ((x >> rot) | (x << ((64 - rot) & 63))) & _M64

    def next32(self) -> int:  # numpy's buffered uint32: low half first, then high half
        if not self.bcnt:
            self.buf, self.bcnt = self.next64(), 1
        else:
            self.buf, self.bcnt = self.buf >> 32, 0
        return self.buf & _M32

    def bounded(self, rng: int) -> int:
        """A uniform integer in [0, rng] (Lemire's method, as numpy's bounded fill)."""
        bits, draw = (32, self.next32) if rng <= _M32 else (64, self.next64)
        excl, mask = rng + 1, (1 << bits) - 1
        m = draw() * excl
        if m & mask < excl:
            threshold = (mask - rng) % excl
            while m & mask < threshold:
                m = draw() * excl
        return m >> bits


def layer_multipliers(seed: int, layer_id: int, max_ngram: int, compressed_vocab: int) -> list[int]:
    """The odd multipliers of one Engram layer (engram-titan's hashing.layer_multipliers)."""
    g = _PCG64(int(seed) + 10007 * int(layer_id))
    rng = max(1, (_INT64_MAX // int(compressed_vocab)) // 2) - 1
    return [2 * (g.bounded(rng) if rng else 0) + 1 for _ in range(max_ngram)]


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit integers."""
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    if n < 2:
        return False
    for p in bases:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def table_primes(
    vocab_size_per_ngram, layer_ids, max_ngram: int, heads: int
) -> dict[str, list[int]]:
    """Each layer's head primes, order-major: the smallest unused prime above a search start
    that begins at vocab_size_per_ngram[n - 2] - 1 and moves to each prime found."""
    used, out = set(), {}
    for layer in layer_ids:
        flat = []
        for n in range(2, max_ngram + 1):
            start = int(vocab_size_per_ngram[n - 2]) - 1
            for _ in range(heads):
                c = start + 1
                while c in used or not _is_prime(c):
                    c += 1
                used.add(c)
                flat.append(c)
                start = c
        out[str(layer)] = flat
    return out


def derive_hash_params(engram: dict) -> dict[str, dict]:
    """multipliers, table_primes and table_rows (keyed by str(layer)) from config.engram's seed
    and sizes; ValueError naming every stored value that disagrees (an edited config.json)."""
    need = ("seed", "layer_ids", "max_ngram", "n_head_per_ngram", "vocab_size_per_ngram",
            "compressed_vocab")  # fmt: skip
    absent = [k for k in need if k not in engram]
    if absent:
        raise ValueError(
            f"config.json's engram lacks {absent}: re-export the folder with engram-titan's "
            "scripts/export_hf.py"
        )
    layers = [int(i) for i in engram["layer_ids"]]
    max_ngram = int(engram["max_ngram"])
    primes = table_primes(
        engram["vocab_size_per_ngram"], layers, max_ngram, int(engram["n_head_per_ngram"])
    )
    derived = {
        "multipliers": {
            str(i): layer_multipliers(engram["seed"], i, max_ngram, engram["compressed_vocab"])
            for i in layers
        },
        "table_primes": primes,
        "table_rows": {k: sum(v) for k, v in primes.items()},
    }
    diffs = [
        f"engram.{key}[{layer!r}] = {(engram.get(key) or {}).get(layer)}, derived {want}"
        for key, per_layer in derived.items()
        for layer, want in per_layer.items()
        if not isinstance(engram.get(key), dict) or engram[key].get(layer) != want
    ]
    if diffs:
        raise ValueError(
            f"config.json disagrees with engram.seed = {engram['seed']} and the table sizes "
            "that derive the hashing values:\n  " + "\n  ".join(diffs) + "\nThe file was "
            "edited: restore it from the export, or re-export with the settings you want"
        )
    return derived


class NgramHash(nn.Module):
    """input_ids [B, T] -> Engram row ids [B, T, L, H] (L Engram layers, H hash heads)."""

    def __init__(self, engram: dict) -> None:
        super().__init__()
        self.max_ngram = int(engram["max_ngram"])
        self.n_layers = len(engram["layer_ids"])
        self.pad = int(engram["compressed_pad_id"])
        self.register_buffer("lookup", torch.zeros(int(engram["num_token_ids"]), dtype=torch.long))
        heads = int(engram["n_head_per_ngram"])
        derived = derive_hash_params(engram)  # never the stored values: they could be edited
        primes = [derived["table_primes"][str(i)] for i in engram["layer_ids"]]
        offsets = [[sum(p[:j]) for j in range(len(p))] for p in primes]
        # Python ints, not buffers: derived from the config, and multipliers exceed float precision.
        self._ints = {
            "mult": [derived["multipliers"][str(i)] for i in engram["layer_ids"]],
            "primes": [p[k : k + heads] for p in primes for k in range(0, len(p), heads)],
            "offsets": [o[k : k + heads] for o in offsets for k in range(0, len(o), heads)],
        }
        self._on: dict[torch.device, dict[str, torch.Tensor]] = {}

    def compress(self, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Compressed ids; masked positions (mask 0) become the compressed pad id."""
        if input_ids.numel() and (
            int(input_ids.min()) < 0 or int(input_ids.max()) >= self.lookup.numel()
        ):
            raise ValueError(
                f"token ids must be in [0, {self.lookup.numel()}) (the tokenizer's ids; rows past it "
                "are embedding padding): generate with suppress_tokens for them "
                "(generation_config.json does this)"
            )
        x = self.lookup[input_ids]
        return x if mask is None else torch.where(mask.bool(), x, torch.full_like(x, self.pad))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """x: compressed ids [B, T]; context: the max_ngram - 1 compressed ids before them."""
        if x.device not in self._on:
            self._on[x.device] = {
                k: torch.tensor(v, device=x.device) for k, v in self._ints.items()
            }
        t = self._on[x.device]
        k_max = self.max_ngram - 1
        full = torch.cat([context, x], dim=1)
        b, n = x.shape
        acc = x[:, :, None] * t["mult"][:, 0]  # [B, T, L], wrapping int64 as numpy
        mix = []
        for k in range(1, self.max_ngram):
            acc = acc ^ (full[:, k_max - k : k_max - k + n, None] * t["mult"][:, k])
            mix.append(acc)
        mix = torch.stack(mix, dim=-1).reshape(b, n, -1, 1)  # [B, T, L * (max_ngram - 1), 1]
        ids = torch.remainder(mix, t["primes"]) + t["offsets"]
        return ids.reshape(b, n, self.n_layers, -1)


class ShortConv(nn.Module):
    """RMSNorm, depthwise causal dilated Conv1d over time, SiLU (one residual branch)."""

    def __init__(self, dim: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.window = (kernel_size - 1) * dilation
        self.norms = nn.ModuleList([RMSNorm(dim, SHORT_CONV_NORM_EPS)])
        self.conv = nn.Conv1d(
            dim, dim, kernel_size, groups=dim, bias=False, padding=self.window, dilation=dilation
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, layer_cache) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; the window before x comes from layer_cache (else zeros)."""
        t = x.shape[1]
        normed = self.norms[0](x)
        if mask is not None:
            normed = normed * mask[:, :, None].to(normed.dtype)
        normed = normed.transpose(1, 2)  # [B, D, T]
        if (
            layer_cache is None
            or self.window == 0
            or not layer_cache.has_previous_state[CONV_STATE]
        ):
            y = self.conv(normed)[..., :t]  # symmetric zero padding, first T outputs = causal
            if layer_cache is not None and self.window > 0:  # keep the window for the next step
                layer_cache.update_conv_state(
                    F.pad(normed, (self.window, 0)),
                    state_idx=CONV_STATE,
                    conv_kernel_size=self.window,
                )
        else:
            full = layer_cache.update_conv_state(normed, state_idx=CONV_STATE)  # [B, D, window + T]
            y = F.conv1d(full, self.conv.weight, dilation=self.conv.dilation, groups=x.shape[-1])
        return F.silu(y).transpose(1, 2)


class EngramBlock(nn.Module):
    """Hashed n-gram lookup -> context-aware gate -> value + ShortConv(value) (hc_mult 1)."""

    def __init__(self, dim: int, engram: dict, rows: int) -> None:
        super().__init__()
        engram_dim = (engram["max_ngram"] - 1) * engram["n_embed_per_ngram"]
        bias = engram["use_bias"]
        self.dim = dim
        self.table = nn.Embedding(rows, engram["head_dim"])
        self.value_proj = nn.Linear(engram_dim, dim, bias=bias)
        self.key_projs = nn.ModuleList([nn.Linear(engram_dim, dim, bias=bias)])
        self.key_norms = nn.ModuleList([RMSNorm(dim, GATE_NORM_EPS)])
        self.query_norms = nn.ModuleList([RMSNorm(dim, GATE_NORM_EPS)])
        self.short_conv = ShortConv(dim, engram["kernel_size"], dilation=engram["max_ngram"])

    def forward(self, hidden, hash_ids, mask, layer_cache) -> torch.Tensor:
        e = self.table(hash_ids).flatten(-2).to(hidden.dtype)  # [B, T, engram_dim]
        key = self.key_norms[0](self.key_projs[0](e))
        query = self.query_norms[0](hidden)
        gate = (key * query).sum(-1) * (1.0 / math.sqrt(self.dim))
        gate = (gate.abs().clamp_min(1e-6).sqrt() * gate.sign()).sigmoid()
        value = gate[..., None] * self.value_proj(e)
        return value + self.short_conv(value, mask, layer_cache)


class _EngramCausalLM:
    """Mixin over a transformers *ForCausalLM: Engram blocks, hashing and their cache state."""

    def _add_engram(self, config) -> None:
        e = config.engram
        if e.get("hc_mult", 1) != 1:
            raise ValueError(f"engram.hc_mult = {e['hc_mult']}: this file computes hc_mult 1 only")
        self.engram_hash = NgramHash(e)
        self._engram_layers = [int(i) for i in e["layer_ids"]]
        self._engram_step: dict | None = None
        for slot, lid in enumerate(self._engram_layers):
            layer = self.model.layers[lid]
            layer.engram = EngramBlock(config.hidden_size, e, int(e["table_rows"][str(lid)]))
            layer.register_forward_pre_hook(
                functools.partial(self._engram_pre_hook, slot, lid), with_kwargs=True
            )
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, output_loading_info: bool = False, **kwargs):
        """transformers' loader, but a folder with missing, unexpected or mis-shaped tensors is
        refused (a damaged or mismatched export), never filled with random weights."""
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        bad = {k: sorted(v)[:10] for k, v in info.items() if k != "error_msgs" and v}
        if bad or info.get("error_msgs"):
            raise ValueError(
                f"the checkpoint does not match the Engram model: {bad or info['error_msgs']}"
            )
        model._check_lookup()
        return (model, info) if output_loading_info else model

    def _check_lookup(self) -> None:
        """The saved compression table must give the compressed vocabulary and pad id the
        config states (the multipliers were derived from them)."""
        e, lookup = self.config.engram, self.engram_hash.lookup
        got = (int(lookup.max()) + 1, int(lookup[int(e["pad_id"])]))
        want = (int(e["compressed_vocab"]), int(e["compressed_pad_id"]))
        if got != want:
            raise ValueError(
                f"engram_hash.lookup gives compressed_vocab, compressed_pad_id = {got}, but "
                f"config.json's engram states {want}: the folder was edited; re-export it"
            )

    def _engram_cache(self, cache):
        """Make the Engram layers' cache layers KV + conv-state layers (only while empty)."""
        for lid in self._engram_layers:
            while len(cache.layers) <= lid:
                cache.layers.append(DynamicLayer())
            layer = cache.layers[lid]
            if isinstance(layer, LinearAttentionAndFullAttentionLayer):
                continue
            if layer.get_seq_length() > 0:
                raise ValueError(
                    f"the cache already holds tokens but no Engram state for layer {lid}: start "
                    "generation from an empty cache"
                )
            cache.layers[lid] = LinearAttentionAndFullAttentionLayer(number_of_states=2)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        if input_ids is None:
            raise ValueError("Engram hashes token ids: pass input_ids, not inputs_embeds")
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        t = input_ids.shape[1]
        mask = None
        if (
            attention_mask is not None
            and attention_mask.dim() == 2
            and not bool(attention_mask[:, -t:].all())
        ):
            mask = attention_mask[:, -t:]
        x = self.engram_hash.compress(input_ids, mask)
        k_max = self.engram_hash.max_ngram - 1
        context = torch.full(
            (x.shape[0], k_max), self.engram_hash.pad, dtype=x.dtype, device=x.device
        )
        if cache is not None:
            self._engram_cache(cache)
            tokens = cache.layers[self._engram_layers[0]]
            if not tokens.has_previous_state[TOKEN_STATE]:
                x_in = torch.cat([context, x], dim=1)  # the row starts here: pad before it
            else:
                x_in = x
            full = tokens.update_conv_state(
                x_in[:, None], state_idx=TOKEN_STATE, conv_kernel_size=k_max
            )
            context = full[:, 0, :k_max]
        self._engram_step = {
            "hash_ids": self.engram_hash(x, context),
            "mask": mask,
            "cache": cache,
        }
        try:
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        finally:
            self._engram_step = None

    def _engram_pre_hook(self, slot: int, lid: int, layer, args, kwargs):
        step = self._engram_step
        if step is None:
            raise RuntimeError("an Engram layer ran outside the Engram model's forward")
        hidden = args[0] if args else kwargs["hidden_states"]
        layer_cache = step["cache"].layers[lid] if step["cache"] is not None else None
        hidden = hidden + layer.engram(
            hidden, step["hash_ids"][:, :, slot], step["mask"], layer_cache
        )
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}


# config.json's model_type is engram_llama / engram_qwen2 / engram_qwen3, transformers knows none
# of them: AutoModelForCausalLM without trust_remote_code refuses the folder instead of building
# the plain backbone (which would drop every Engram weight). The configs are the backbone's.
class EngramLlamaConfig(LlamaConfig):
    model_type = "engram_llama"


class EngramQwen2Config(Qwen2Config):
    model_type = "engram_qwen2"


class EngramQwen3Config(Qwen3Config):
    model_type = "engram_qwen3"


class EngramLlamaForCausalLM(_EngramCausalLM, LlamaForCausalLM):
    config_class = EngramLlamaConfig

    def __init__(self, config) -> None:
        super().__init__(config)
        self._add_engram(config)


class EngramQwen2ForCausalLM(_EngramCausalLM, Qwen2ForCausalLM):
    config_class = EngramQwen2Config

    def __init__(self, config) -> None:
        super().__init__(config)
        self._add_engram(config)


class EngramQwen3ForCausalLM(_EngramCausalLM, Qwen3ForCausalLM):
    config_class = EngramQwen3Config

    def __init__(self, config) -> None:
        super().__init__(config)
        self._add_engram(config)
