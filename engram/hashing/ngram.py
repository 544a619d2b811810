"""Engram tokenizer compression and multi-head n-gram hashing (bit-exact with DeepSeek's demo).

Reference: `CompressedTokenizer` and `NgramHashMapping` in DeepSeek's official Engram demo
(engram_demo_v1.py). Per Engram layer, every n-gram order n = 2..max_ngram has
`n_head_per_ngram` hash heads; head j of order n maps position t to

    mix = XOR_{k<n} (x[t-k] * m_k)  (wrapping int64; x = compressed ids, left-padded with the
                                      compressed pad id)
    id  = mix mod p_{n,j}           (non-negative, numpy `%`)

with odd multipliers m from default_rng(seed + 10007 * layer_id) and distinct primes p searched
upward from vocab_size_per_ngram[n-2] - 1, globally unique over all layers and heads. We add each
head's offset into the layer's concatenated table (exclusive cumsum of the layer's primes).

Optional `segment_ids` make n-grams stop at document boundaries of packed sequences: the token
at t-k counts as the pad id when it belongs to another segment than the token at t.

The CPU path computes the modulo with exact float64 arithmetic: in C (engram/hashing/csrc/ngram_hash.c,
built by `pip install`) or, without it, with numpy/torch calls (engram/hashing/kernels.py);
`hash_torch` uses plain int64 torch ops on accelerators. All equal the reference bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engram.hashing import native as _hash_native
from engram.hashing.kernels import CpuNgramKernel, ExactModPlan, mod_with_offsets, plan_exact_mod

if TYPE_CHECKING:
    import tokenizers

    from engram.config import Engram as EngramConfig

SENTINEL = "\ue000"
LAYER_SEED_STRIDE = 10007
_INT64_MAX = int(np.iinfo(np.int64).max)


# --- tokenizer compression -------------------------------------------------------------------


def compression_normalizer() -> tokenizers.normalizers.Normalizer:
    """The demo's text normaliser: NFKC, strip accents, lower case, collapse whitespace."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            # A token that is only whitespace keeps one space instead of stripping to "".
            normalizers.Replace(Regex(r"^ $"), SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(SENTINEL, " "),
        ]
    )


def build_compression_lookup(tokenizer: tokenizers.Tokenizer) -> tuple[np.ndarray, int]:
    """(lookup int64[vocab], compressed vocab size): ids whose decoded text normalises equally
    share one new id, numbered in first-seen order. Tokens that decode to U+FFFD (partial
    UTF-8 bytes) are keyed by their raw token string instead."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[tid] for tid in range(vocab)], skip_special_tokens=False)
    normalizer = compression_normalizer()
    key_to_new: dict[str, int] = {}
    lookup = np.empty(vocab, dtype=np.int64)
    for tid, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.id_to_token(tid)
        else:
            norm = normalizer.normalize_str(text)
            key = norm if norm else text
        lookup[tid] = key_to_new.setdefault(key, len(key_to_new))
    return lookup, len(key_to_new)


# --- primes and multipliers ------------------------------------------------------------------

# Deterministic for every n < 3.3e24 (Sorenson & Webster), which covers int64.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit integers."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
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


def find_table_primes(
    vocab_size_per_ngram: Sequence[int],
    layer_ids: Sequence[int],
    max_ngram: int,
    n_head_per_ngram: int,
) -> dict[int, list[int]]:
    """Table size of every (order, head) per layer: the smallest unused prime above the search
    start, which begins at vocab_size_per_ngram[n-2] - 1 and moves to each prime found. One set
    of used primes spans all layers (in the given order). Values are flat, order-major."""
    _check_shape_args(vocab_size_per_ngram, max_ngram, n_head_per_ngram)
    used: set[int] = set()
    sizes: dict[int, list[int]] = {}
    for layer_id in layer_ids:
        flat: list[int] = []
        for n in range(2, max_ngram + 1):
            start = int(vocab_size_per_ngram[n - 2]) - 1
            for _ in range(n_head_per_ngram):
                candidate = start + 1
                while candidate in used or not is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                flat.append(candidate)
                start = candidate
        sizes[int(layer_id)] = flat
    return sizes


def engram_table_rows(engram_cfg: EngramConfig) -> dict[int, int]:
    """Rows of each Engram layer's concatenated table (the sum of its head primes), from the
    config alone: no tokenizer needed. Equals NgramHasher.from_config(...).table_rows."""
    e = engram_cfg
    if not (e.enabled and e.layer_ids):
        return {}
    sizes = find_table_primes(e.vocab_size_per_ngram, e.layer_ids, e.max_ngram, e.n_head_per_ngram)
    return {layer: sum(primes) for layer, primes in sizes.items()}


def layer_multipliers(
    seed: int, layer_id: int, max_ngram: int, compressed_vocab: int
) -> np.ndarray:
    """Odd int64 multipliers [max_ngram] for one layer; products with ids < compressed_vocab
    never overflow int64."""
    g = np.random.default_rng(int(seed + LAYER_SEED_STRIDE * int(layer_id)))
    half_bound = max(1, (_INT64_MAX // int(compressed_vocab)) // 2)
    r = g.integers(low=0, high=half_bound, size=(max_ngram,), dtype=np.int64)
    return r * 2 + 1


def _check_shape_args(
    vocab_size_per_ngram: Sequence[int], max_ngram: int, n_head_per_ngram: int
) -> None:
    if max_ngram < 2:
        raise ValueError(f"max_ngram must be >= 2 (n-gram orders start at 2), got {max_ngram}")
    if len(vocab_size_per_ngram) != max_ngram - 1:
        raise ValueError(
            f"vocab_size_per_ngram needs one entry per order 2..{max_ngram} "
            f"({max_ngram - 1} entries), got {list(vocab_size_per_ngram)}"
        )
    if any(int(v) <= 0 for v in vocab_size_per_ngram):
        raise ValueError(
            f"vocab_size_per_ngram entries must be > 0, got {list(vocab_size_per_ngram)}"
        )
    if n_head_per_ngram <= 0:
        raise ValueError(f"n_head_per_ngram must be > 0, got {n_head_per_ngram}")


# --- hasher -----------------------------------------------------------------------------------


class NgramHasher:
    """Token ids [B, T] -> Engram table row ids [B, T, L, H] (offsets included)."""

    def __init__(
        self,
        *,
        layer_ids: Sequence[int],
        max_ngram: int,
        n_head_per_ngram: int,
        vocab_size_per_ngram: Sequence[int],
        seed: int,
        pad_id: int,
        lookup: np.ndarray | None,
        vocab_size: int,
        kernel: str = "auto",
    ) -> None:
        """kernel: "auto" (the C kernel when built, else numpy/torch), "native" (the C kernel,
        an error when it is not built) or "python" (numpy/torch)."""
        if kernel not in ("auto", "native", "python"):
            raise ValueError(f"kernel must be 'auto', 'native' or 'python', got {kernel!r}")
        if kernel == "native" and not _hash_native.available():
            raise RuntimeError(
                "the C hashing kernel (engram.hashing._ngram_hash) is not built: reinstall with a C "
                "compiler (pip install -e .) or use kernel='auto'"
            )
        _check_shape_args(vocab_size_per_ngram, max_ngram, n_head_per_ngram)
        if not layer_ids:
            raise ValueError("layer_ids is empty: give at least one Engram layer id")
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"layer_ids has duplicates: {list(layer_ids)}")
        if lookup is None:
            if vocab_size <= 0:
                raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
            self.num_ids = int(vocab_size)
            self.compressed_vocab = int(vocab_size)
            self.lookup = None
        else:
            lookup = np.ascontiguousarray(lookup, dtype=np.int64)
            if lookup.ndim != 1 or lookup.size == 0 or lookup.min() < 0:
                raise ValueError("lookup must be a non-empty 1-D array of non-negative new ids")
            self.num_ids = int(lookup.size)
            self.compressed_vocab = int(lookup.max()) + 1
            self.lookup = lookup
        if not 0 <= pad_id < self.num_ids:
            raise ValueError(
                f"pad_id {pad_id} is outside the token id range [0, {self.num_ids}): set "
                "engram.pad_id to an id of the tokenizer (the original id, before compression)"
            )
        self.vocab_size = int(vocab_size)
        self.layer_ids = [int(i) for i in layer_ids]
        self.max_ngram = int(max_ngram)
        self.n_head_per_ngram = int(n_head_per_ngram)
        self.num_heads = (self.max_ngram - 1) * self.n_head_per_ngram
        self.pad_id = int(pad_id)
        self.compressed_pad_id = (
            int(self.lookup[pad_id]) if self.lookup is not None else self.pad_id
        )
        self.multipliers = np.stack(
            [
                layer_multipliers(seed, i, self.max_ngram, self.compressed_vocab)
                for i in self.layer_ids
            ]
        )  # int64 [L, max_ngram]
        self.table_sizes = find_table_primes(
            vocab_size_per_ngram, self.layer_ids, self.max_ngram, self.n_head_per_ngram
        )
        self.table_rows = {i: sum(s) for i, s in self.table_sizes.items()}
        self.offsets = {
            i: np.concatenate([[0], np.cumsum(s[:-1])]).astype(np.int64)
            for i, s in self.table_sizes.items()
        }
        groups = len(self.layer_ids) * (self.max_ngram - 1)
        self._primes = np.array(
            [self.table_sizes[i] for i in self.layer_ids], dtype=np.int64
        ).reshape(groups, self.n_head_per_ngram)
        self._offsets = np.stack([self.offsets[i] for i in self.layer_ids]).reshape(
            groups, self.n_head_per_ngram
        )
        # Fast path precondition: ids in [0, compressed_vocab) give 0 <= x * m < 2**63, so every
        # XOR mix is non-negative. (Always true for the demo's multiplier bound.)
        max_product = (self.compressed_vocab - 1) * int(self.multipliers.max())
        self._plan: ExactModPlan | None = (
            plan_exact_mod(self._primes, self._offsets) if max_product <= _INT64_MAX else None
        )
        use_native = (
            kernel != "python"
            and _hash_native.available()
            and self._plan is not None
            and self._plan.by_parts
            and self.compressed_vocab <= 2**31  # the C kernel's lookup is int32
        )
        self._native = (
            _hash_native.NativeNgramKernel(
                self.multipliers, self.lookup, self.num_ids, self.compressed_pad_id, self._plan
            )
            if use_native
            else None
        )
        if kernel == "native" and self._native is None:
            raise ValueError(
                "kernel='native' needs table primes below ~2.49e9 (the 16-bit-parts exactness "
                "plan); use kernel='auto'"
            )
        # The numpy/torch kernel, when the C one does not run (ids < 0 take numpy `%` either way).
        self._kernel = (
            None
            if self._plan is None or self._native is not None
            else CpuNgramKernel(self.multipliers, self.lookup, self.compressed_pad_id, self._plan)
        )
        self._device_tables: dict[
            torch.device, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}

    @classmethod
    def from_config(
        cls, engram_cfg: EngramConfig, tokenizer_or_none: Any, vocab_size: int
    ) -> NgramHasher:
        """Build from the [engram] config (its defaults are the defaults). `tokenizer_or_none`: a
        `tokenizers.Tokenizer`, or an object with `.hf` (and `.pad_id`) wrapping one; needed for
        compression and for pad_id < 0 (= the tokenizer's pad id)."""
        hf = getattr(tokenizer_or_none, "hf", tokenizer_or_none)
        compress = engram_cfg.compress_tokenizer
        pad_id = engram_cfg.pad_id
        if pad_id < 0:
            pad_id = _tokenizer_pad_id(tokenizer_or_none, hf)
        lookup = None
        if compress:
            if hf is None:
                raise ValueError(
                    "engram.compress_tokenizer is true but no tokenizer was given: pass the "
                    "tokenizer to NgramHasher.from_config or set engram.compress_tokenizer = false"
                )
            lookup, _ = build_compression_lookup(hf)
        return cls(
            layer_ids=list(engram_cfg.layer_ids),
            max_ngram=engram_cfg.max_ngram,
            n_head_per_ngram=engram_cfg.n_head_per_ngram,
            vocab_size_per_ngram=list(engram_cfg.vocab_size_per_ngram),
            seed=engram_cfg.seed,
            pad_id=pad_id,
            lookup=lookup,
            vocab_size=int(vocab_size),
        )

    def __repr__(self) -> str:
        return (
            f"NgramHasher(layers={self.layer_ids}, max_ngram={self.max_ngram}, heads={self.num_heads}, "
            f"compressed_vocab={self.compressed_vocab}/{self.num_ids}, rows={self.table_rows}, "
            f"kernel={self.kernel_name})"
        )

    @property
    def kernel_name(self) -> str:
        """The CPU kernel `__call__` uses for non-negative ids."""
        if self._native is not None:
            return "native"
        return "python" if self._kernel is not None else "numpy-mod"

    # --- numpy path (data loader) ---

    def __call__(self, input_ids: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
        """int64 [B, T, L, H] row ids for int [B, T] token ids (original tokenizer ids).
        Single-threaded: data-loader workers give the parallelism."""
        ids = self._as_int64_rows(np.asarray(input_ids))
        seg = self._check_segments(segment_ids, ids.shape)
        b, t = ids.shape
        out = np.empty((b, t, len(self.layer_ids), self.num_heads), dtype=np.int64)
        if out.size == 0:
            return out
        # The C kernel checks the id range itself (one pass less); other paths check first.
        if self._native is not None and self._native(ids, out, seg):
            return out
        has_negative = self._check_range(ids)
        if self._native is not None and not has_negative:
            raise RuntimeError("the C hashing kernel rejected ids that are in range")
        if self._kernel is None or has_negative:  # primes too large for the float kernel, ids < 0
            mix = self._mix(ids, seg, has_negative).reshape(-1, b * t)
            res = np.mod(mix.T[:, :, None], self._primes[None]) + self._offsets[None]
            out.reshape(b * t, -1)[:] = res.reshape(b * t, -1)
            return out
        if seg is None:
            self._kernel(ids, out)
        else:
            mix = self._mix(ids, seg, False).reshape(-1, b * t)
            mod_with_offsets(mix, self._kernel.plan, np.reshape(out, (b * t, -1), copy=False))
        return out

    @staticmethod
    def _as_int64_rows(ids: np.ndarray) -> np.ndarray:
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be integers, got dtype {ids.dtype}")
        return ids.astype(np.int64, copy=False)

    def _check_range(self, ids: np.ndarray) -> bool:
        """Whether any id is negative (the demo's pass-through case); raises for ids too large."""
        if ids.size == 0:
            return False
        # One pass in the common case: as uint64, negative ids are huge.
        if int(ids.view(np.uint64).max()) < self.num_ids:
            return False
        if int(ids.max()) >= self.num_ids:
            raise ValueError(
                f"input id {int(ids.max())} >= {self.num_ids}, the number of token ids the hasher "
                "was built for: build it from the tokenizer that produced these ids"
            )
        return int(ids.min()) < 0

    def _check_segments(
        self, segment_ids: np.ndarray | None, shape: tuple[int, ...]
    ) -> np.ndarray | None:
        if segment_ids is None:
            return None
        seg = np.asarray(segment_ids)
        if seg.shape != shape:
            raise ValueError(f"segment_ids shape {seg.shape} != input_ids shape {shape}")
        return seg

    def _mix(self, ids: np.ndarray, seg: np.ndarray | None, has_negative: bool) -> np.ndarray:
        """XOR mixes int64 [G, B, T], G = L * (max_ngram - 1) in (layer, n) order, of the
        compressed ids left-padded with the compressed pad id."""
        b, t = ids.shape
        k_max = self.max_ngram - 1
        width = t + k_max
        padded = np.empty((b, width), dtype=np.int64)
        padded[:, :k_max] = self.compressed_pad_id
        if self.lookup is None:
            padded[:, k_max:] = ids
        elif has_negative:  # the demo leaves negative ids unchanged
            padded[:, k_max:] = np.where(ids >= 0, self.lookup[np.maximum(ids, 0)], ids)
        else:
            self.lookup.take(ids, out=padded[:, k_max:])
        shifts = np.empty((self.max_ngram, b, t), dtype=np.int64)
        for k in range(self.max_ngram):
            shifts[k] = padded[:, k_max - k : k_max - k + t]
            if seg is not None and 0 < k < t:
                # Positions t < k already hold the pad; mask look-back into other documents.
                shifts[k][:, k:][seg[:, k:] != seg[:, :-k]] = self.compressed_pad_id
        layers = len(self.layer_ids)
        terms = self.multipliers[:, :, None, None] * shifts  # [L, max_ngram, B, T], wrapping
        mix = np.empty((layers, k_max, b, t), dtype=np.int64)
        acc = terms[:, 0]
        for i in range(k_max):
            acc = np.bitwise_xor(acc, terms[:, i + 1], out=mix[:, i])
        return mix.reshape(layers * k_max, b, t)

    # --- torch path (generation on device) ---

    def hash_torch(
        self, input_ids: torch.Tensor, segment_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Same ids as `__call__`, computed on input_ids.device with int64 torch ops.

        CPU tensors go through the (faster) numpy kernel without copies."""
        if input_ids.device.type == "cpu":
            ids = input_ids.detach().contiguous().numpy()
            seg = None if segment_ids is None else segment_ids.detach().cpu().numpy()
            return torch.from_numpy(self(ids, seg))
        return self._hash_torch_ops(input_ids, segment_ids)

    def _tables_on(
        self, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        if device not in self._device_tables:
            self._device_tables[device] = (
                None if self.lookup is None else torch.from_numpy(self.lookup).to(device),
                torch.from_numpy(self.multipliers).to(device),
                torch.from_numpy(self._primes).to(device),
                torch.from_numpy(self._offsets).to(device),
            )
        return self._device_tables[device]

    def _hash_torch_ops(
        self, input_ids: torch.Tensor, segment_ids: torch.Tensor | None
    ) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}"
            )
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integers, got dtype {input_ids.dtype}")
        x = input_ids.long()
        if x.numel() and int(x.max()) >= self.num_ids:
            raise ValueError(
                f"input id {int(x.max())} >= {self.num_ids}, the number of token ids the hasher "
                "was built for: build it from the tokenizer that produced these ids"
            )
        if segment_ids is not None and segment_ids.shape != x.shape:
            raise ValueError(
                f"segment_ids shape {tuple(segment_ids.shape)} != input_ids shape {tuple(x.shape)}"
            )
        lookup, mult, primes, offsets = self._tables_on(x.device)
        if lookup is not None:
            x = torch.where(x >= 0, lookup[x.clamp_min(0)], x)
        b, t = x.shape
        pad = self.compressed_pad_id
        mix = torch.empty(
            (b, t, len(self.layer_ids), self.max_ngram - 1), dtype=torch.int64, device=x.device
        )
        acc = x[:, :, None] * mult[:, 0]  # [B, T, L]
        for k in range(1, self.max_ngram):
            shifted = torch.full_like(x, pad)
            if k < t:
                shifted[:, k:] = x[:, :-k]
                if segment_ids is not None:
                    other = segment_ids[:, k:] != segment_ids[:, :-k]
                    shifted[:, k:] = torch.where(other, torch.full_like(x[:, k:], pad), x[:, :-k])
            acc = acc ^ (shifted[:, :, None] * mult[:, k])
            mix[..., k - 1] = acc
        groups = primes.shape[0]
        res = torch.remainder(mix.reshape(b, t, groups, 1), primes) + offsets
        return res.reshape(b, t, len(self.layer_ids), self.num_heads)


def _tokenizer_pad_id(wrapper: Any, hf: Any) -> int:
    """engram.pad_id < 0 means the tokenizer's pad (else eos) id, as engram/data/tokenizer.py finds it."""
    if wrapper is not None and getattr(wrapper, "pad_id", None) is not None:
        return int(wrapper.pad_id)
    if hf is None:
        raise ValueError(
            "engram.pad_id = -1 (the tokenizer's pad id) needs the tokenizer: pass it to "
            "NgramHasher.from_config or set engram.pad_id to a token id"
        )
    from engram.data.tokenizer import Tokenizer

    return Tokenizer(hf).pad_id
