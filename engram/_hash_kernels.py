"""Exact ``mix % p + offset`` for many primes at once, without integer division.

Integer division does not vectorise on CPUs (numpy `%` on int64 runs ~40 M/s here) and the
hasher needs 32 of them per token. This module computes the same integers with float64 SIMD
arithmetic in four passes, exact by the argument below (checked per prime set by
`plan_exact_mod`, and tested against numpy `%` in tests/test_hashing.py).

Notation: u = 2**-53 (unit roundoff), p a prime, mix a non-negative int64, r = mix mod p.

1. Split ``mix = hi * 2**k + lo`` (hi < 2**(63-k), lo < 2**k, both exact doubles), so
   ``mix = v (mod p)`` with ``v = hi * C + lo`` and ``C = 2**k mod p``; k minimises vmax, the
   largest possible v, and ``r = v mod p``; write v = q p + r.
2. One small matrix product per group, ``[hi, lo, 1] @ [C*inv; inv; inv/4]`` (inv = fl(1/p)),
   gives ``y ~ (v + 1/4) / p = q + (r + 1/4) / p``. Each column has three non-zero terms (adding
   exact zeros does not round), so whatever the BLAS summation order, the roundings of inv, of
   C*inv, of the products and of the two additions give
   ``|y - (v + 1/4)/p| <= 5.01 u (v + 1/4) / p =: e / p``, and e < 0.21 whenever
   ``12 (vmax + 1) < 2**52``.
3. Then y lies strictly inside (q, q + 1), so ``f = frac(y) = y - q`` (exact) and
   ``f * p = r + 1/4 + e'`` with |e'| < 0.21 + 2**-19. Adding ``2**52 + offset`` rounds to the
   integer grid of [2**52, 2**53): the sum's fractional part is in (0.04, 0.46), so it rounds
   down to exactly ``2**52 + offset + r``.
4. A double in [2**52, 2**53) carries its integer value in its low mantissa bits: subtracting
   the bit pattern of 2**52 as int64 converts it (a float->int cast is 2.5x slower).

Passes per chunk: product, frac, addcmul, subtract. `plan_exact_mod` returns None when the primes
are too large (p > ~3.8e9) or the offsets too big; callers then use numpy `%`. Each
[n, 3] @ [3, heads] product is far below OpenBLAS's threading threshold (m*n*k < 262144), so BLAS
stays single-threaded.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

MAGIC = 2.0**52
MAGIC_BITS = int(np.array(MAGIC, dtype=np.float64).view(np.int64))
# Elements per chunk of the float stage: its buffer (512 KiB) stays in L2.
CHUNK_ELEMENTS = 1 << 16


def split_value_bound(max_prime: int, split_bits: int) -> int:
    """Largest v = hi * C + lo over hi < 2**(63-k), lo < 2**k, C <= p - 1."""
    return ((1 << (63 - split_bits)) - 1) * (max_prime - 1) + (1 << split_bits) - 1


def quotient_is_exact(vmax: int) -> bool:
    """Step 2 of the module docstring: the error e stays below 0.21 for all v <= vmax."""
    return 12 * (vmax + 1) < 1 << 52


def choose_split_bits(max_prime: int) -> int | None:
    """Split point k that minimises the largest v, or None when no k keeps the result exact."""
    best = min(range(11, 53), key=lambda k: split_value_bound(max_prime, k))
    return best if quotient_is_exact(split_value_bound(max_prime, best)) else None


@dataclass(frozen=True)
class ExactModPlan:
    """Constants for ``out[:, g*heads + j] = mix[g] % primes[g, j] + offsets[g, j]``."""

    split_bits: int
    weight: np.ndarray  # float64 [G, 3, heads]: rows C*inv, inv, inv/4
    prime: torch.Tensor  # float64 [G * heads]
    magic_offset: torch.Tensor  # float64 [G * heads]: 2**52 + offset


def plan_exact_mod(primes: np.ndarray, offsets: np.ndarray) -> ExactModPlan | None:
    """primes, offsets: int64 [G, heads]. None when the float kernel cannot be exact."""
    pmin, pmax = int(primes.min()), int(primes.max())
    k = choose_split_bits(pmax) if pmin >= 2 else None
    if k is None or int(offsets.max()) + pmax >= 1 << 52:
        return None
    p = primes.astype(np.float64)
    inv = 1.0 / p
    split_residue = np.array([[(1 << k) % int(q) for q in row] for row in primes], dtype=np.float64)
    return ExactModPlan(
        split_bits=k,
        weight=np.stack([split_residue * inv, inv, 0.25 * inv], axis=1),
        prime=torch.from_numpy(p.reshape(-1)),
        magic_offset=torch.from_numpy(MAGIC + offsets.reshape(-1).astype(np.float64)),
    )


# ATen runs an elementwise op on the calling thread up to this many elements; above it, with
# torch.get_num_threads() > 1, it forks an OpenMP team, which made hashing 4-8x slower on a busy
# 2-core machine. The torch passes are split into pieces of at most this size instead.
_ATEN_GRAIN = 32768


_RowSlice = tuple[int, int, torch.Tensor]  # rows [start, end) of out, and y's matching rows


class _Chunk(NamedTuple):
    gemm_in: np.ndarray  # [G, rows, 3] view of hl
    gemm_out: np.ndarray  # [G, rows, heads] view of y
    whole: list[_RowSlice]  # the chunk in one torch call
    pieces: list[_RowSlice]  # the chunk in calls below _ATEN_GRAIN elements


class _Workspace:
    """Buffers and views for one (groups, heads, tokens) shape: built once, reused per call
    (fresh arrays cost page faults; numpy views and torch.from_numpy ~0.5 us each)."""

    def __init__(self, groups: int, heads: int, n: int) -> None:
        cols = groups * heads
        chunk = min(n, max(16, CHUNK_ELEMENTS // cols))
        self.hl = np.empty((groups, 3, n))
        self.hl[:, 2] = 1.0  # the constant row of [hi, lo, 1]
        self.y = np.empty((chunk, cols))
        yt = torch.from_numpy(self.y)
        self.chunks: list[_Chunk] = []
        for s in range(0, n, chunk):
            rows = min(n, s + chunk) - s
            y3 = np.reshape(self.y[:rows], (rows, groups, heads), copy=False)
            piece = max(1, _ATEN_GRAIN // cols)
            piece = -(-rows // -(-rows // piece))  # balanced, still <= _ATEN_GRAIN elements
            pieces = [
                (s + a, s + min(rows, a + piece), yt[a : min(rows, a + piece)])
                for a in range(0, rows, piece)
            ]
            self.chunks.append(
                _Chunk(
                    gemm_in=self.hl[:, :, s : s + rows].transpose(0, 2, 1),
                    gemm_out=y3.transpose(1, 0, 2),
                    whole=[(s, s + rows, yt[:rows])],
                    pieces=pieces,
                )
            )


class _Workspaces(threading.local):
    def get(self, groups: int, heads: int, n: int) -> _Workspace:
        cache: dict[tuple[int, ...], _Workspace] = self.__dict__.setdefault("cache", {})
        key = (groups, heads, n, CHUNK_ELEMENTS)
        ws = cache.get(key)
        if ws is None:
            if len(cache) >= 4:  # shapes vary (e.g. generation): keep memory bounded
                cache.clear()
            ws = cache[key] = _Workspace(groups, heads, n)
        return ws


_WORKSPACES = _Workspaces()


def _mod_into(ws: _Workspace, mix: np.ndarray, plan: ExactModPlan, out: np.ndarray) -> None:
    np.right_shift(mix, plan.split_bits, out=ws.hl[:, 0], casting="unsafe")
    np.bitwise_and(mix, (1 << plan.split_bits) - 1, out=ws.hl[:, 1], casting="unsafe")
    out_t = torch.from_numpy(out.view(np.float64))
    split_torch = torch.get_num_threads() > 1
    for chunk in ws.chunks:
        # Batched [rows, 3] @ [3, heads] products written straight into the [rows, G*heads]
        # layout (3x fewer multiply-adds than one block-sparse product).
        np.matmul(chunk.gemm_in, plan.weight, out=chunk.gemm_out)
        for start, end, yt in chunk.pieces if split_torch else chunk.whole:
            torch.frac(yt, out=yt)
            torch.addcmul(plan.magic_offset, yt, plan.prime, out=out_t[start:end])
    np.subtract(out, MAGIC_BITS, out=out)


def mod_with_offsets(mix: np.ndarray, plan: ExactModPlan, out: np.ndarray) -> None:
    """out[t, g*heads + j] = mix[g, t] % primes[g, j] + offsets[g, j] for int64 mix [G, N] >= 0.

    out: int64 [N, G*heads], C-contiguous; it doubles as the float64 buffer. Runs on the calling
    thread only; buffers are per thread."""
    groups, n = mix.shape
    _mod_into(_WORKSPACES.get(groups, plan.weight.shape[2], n), mix, plan, out)


class _MixWorkspace:
    """Buffers and views of the n-gram mixing stage for one [B, T] shape."""

    def __init__(self, layers: int, max_ngram: int, heads: int, b: int, t: int, pad: int) -> None:
        k_max = max_ngram - 1
        self.padded = np.empty((b, t + k_max), dtype=np.int64)
        self.padded[:, :k_max] = pad
        self.tokens = self.padded[:, k_max:]
        self.prods = np.empty((layers, max_ngram, b, t + k_max), dtype=np.int64)
        self.mix = np.empty((layers, k_max, b, t), dtype=np.int64)
        # The token k steps back is padded[:, k_max - k + t]: multiply once, slice per k.
        self.terms = [self.prods[:, k, :, k_max - k : k_max - k + t] for k in range(max_ngram)]
        self.mix_out = [self.mix[:, i] for i in range(k_max)]
        self.mix_flat = self.mix.reshape(layers * k_max, b * t)
        self.mod = _Workspace(layers * k_max, heads, b * t)


class CpuNgramKernel:
    """The fast CPU path of one hasher: compress -> shifted products -> XOR mixes -> exact mod,
    on per-thread, per-shape buffers (about a dozen numpy/torch calls per batch)."""

    def __init__(
        self, multipliers: np.ndarray, lookup: np.ndarray | None, pad: int, plan: ExactModPlan
    ) -> None:
        self.multipliers = multipliers[:, :, None, None]  # [L, max_ngram, 1, 1]
        self.lookup = lookup
        self.pad = pad
        self.plan = plan
        self._local = threading.local()

    def __getstate__(self) -> dict:
        # Buffers are per thread and per process: data-loader workers (spawn) rebuild them.
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def workspace(self, b: int, t: int) -> _MixWorkspace:
        cache: dict[tuple[int, int], _MixWorkspace] = self._local.__dict__.setdefault("cache", {})
        ws = cache.get((b, t))
        if ws is None:
            if len(cache) >= 4:  # shapes vary (e.g. generation): keep memory bounded
                cache.clear()
            layers, max_ngram = self.multipliers.shape[:2]
            heads = self.plan.weight.shape[2]
            ws = cache[(b, t)] = _MixWorkspace(layers, max_ngram, heads, b, t, self.pad)
        return ws

    def __call__(self, ids: np.ndarray, out: np.ndarray) -> None:
        """ids: int64 [B, T] in [0, len(lookup)); out: int64 [B, T, L, H], C-contiguous."""
        b, t = ids.shape
        ws = self.workspace(b, t)
        if self.lookup is None:
            np.copyto(ws.tokens, ids)
        else:
            self.lookup.take(ids, out=ws.tokens)
        np.multiply(self.multipliers, ws.padded, out=ws.prods)  # wrapping int64
        acc = ws.terms[0]
        for term, mix_out in zip(ws.terms[1:], ws.mix_out, strict=True):
            acc = np.bitwise_xor(acc, term, out=mix_out)
        _mod_into(ws.mod, ws.mix_flat, self.plan, np.reshape(out, (b * t, -1), copy=False))
