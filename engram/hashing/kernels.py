"""Exact ``mix % p + offset`` for many primes at once, without integer division.

Integer division does not vectorise on CPUs (numpy `%` on int64 runs ~40 M/s here) and the
hasher needs 32 of them per token. This module computes the same integers with float64 SIMD
arithmetic in four passes, exact by the argument below (checked per prime set by
`plan_exact_mod`, and tested against numpy `%` in tests/test_hashing.py).

Notation: u = 2**-53 (unit roundoff), p a prime, mix a non-negative int64, r = mix mod p.

1. Write ``mix = sum a_i 2**s_i`` with small parts a_i, so that ``mix = v (mod p)`` with
   ``v = sum a_i C_i``, ``C_i = 2**s_i mod p``; write v = q p + r. Two ways:
   a. primes below ~2.49e9 (`parts_are_exact`): the four 16-bit parts of mix, a free uint16
      view cast to float64 in one pass; mix < 2**63 gives a_3 < 2**15, so v <= vmax :=
      (2**16 - 1)(1 + 2(p - 1)) + (2**15 - 1)(p - 1).
   b. larger primes (up to ~3.8e9, `choose_split_bits`): ``mix = hi * 2**k + lo`` (shift and
      mask, each cast to float64), plus a constant part 1 for the bias of 2b.
2. One small matrix product per group, parts @ weights, gives y:
   a. weights ``w_i = C_i (1 + d) / p`` correctly rounded, d = 6u. With at most four non-zero
      terms per column, whatever the BLAS summation order (any tree has depth <= 3, FMA or
      not), the roundings of w_i, of the products and of the additions perturb each term by a
      relative 5.01u at most: ``y in [(1 + d)(1 - 5.01u) v/p, (1 + d)(1 + 5.01u) v/p]``. The
      lower end exceeds v/p when v > 0 (y = 0 when v = 0), so ``y p = v + eps`` with
      0 <= eps <= 11.02u vmax < 1/2 - 2**-21.
   b. weights ``[C*inv; inv; inv/4]`` (inv = fl(1/p)): ``|y - (v + 1/4)/p| <= 5.01u (v + 1/4)/p
      =: e/p`` with e < 0.21 whenever ``12 (vmax + 1) < 2**52``, so ``y p = v + 1/4 + e``.
   Either way y lies in [q, q + 1) and y p = v + eps with eps in [0, 1/2 - 2**-21) (2a) or
   (0.04, 0.46) (2b), which leaves room for the <= 2**-21 rounding of an unfused f * p below.
3. ``f = frac(y) = y - q`` (exact) and ``f p = r + eps``. Multiplying by p * 2**-1074 and adding
   offset * 2**-1074 rounds, fused or not, to the subnormal grid of spacing 2**-1074: exactly
   ``(r + offset) * 2**-1074``, a double whose bit pattern is the int64 ``r + offset`` (< 2**52):
   out is written as float64 and read as int64, without a conversion pass.
4. Only when the thread flushes subnormals to zero (FTZ/DAZ, `denormals_work`), step 3 adds
   ``2**52 + offset`` instead (rounding to the integer grid of [2**52, 2**53)) and a last pass
   subtracts the bit pattern of 2**52 as int64.

engram/hashing/csrc/ngram_hash.c (the default CPU kernel when `pip install` could compile it) runs steps
1a, 2a, 3 and 4 per token in C, with the weights of `plan_exact_mod`; this module is its fallback.

Passes per chunk: cast, product, frac, addcmul. `plan_exact_mod` returns None when the primes
are too large (p > ~3.8e9) or the offsets too big; callers then use numpy `%`. Each
[n, 4] @ [4, heads] product is far below OpenBLAS's threading threshold (m*n*k < 262144), so
BLAS stays single-threaded.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

import numpy as np
import torch

MAGIC = 2.0**52
MAGIC_BITS = int(np.array(MAGIC, dtype=np.float64).view(np.int64))
# Elements per chunk of the float stage: its rows of out (512 KiB) stay in L2.
CHUNK_ELEMENTS = 1 << 16
# Rows of out per row of the step-3 addcmul: a [rows, 32] broadcast runs its inner loop over
# 32 elements only; [rows / 8, 256] took ~15 % less time here.
ROW_TILE = 8
PART_BITS = 16
PARTS = 4
# Bit position s_i of each uint16 of an int64, in memory order.
_PART_SHIFTS = tuple(PART_BITS * i for i in range(PARTS))
if sys.byteorder != "little":
    _PART_SHIFTS = _PART_SHIFTS[::-1]
_U = Fraction(1, 2**53)
_SMALLEST_SUBNORMAL = 2.0**-1074
_ZERO = 0.0


def parts_value_bound(max_prime: int) -> int:
    """vmax of step 1a: the largest v = sum a_i C_i over mix < 2**63, C_0 = 1, C_i <= p - 1."""
    full, top = (1 << PART_BITS) - 1, (1 << (63 - (PARTS - 1) * PART_BITS)) - 1
    return full * (1 + (PARTS - 2) * (max_prime - 1)) + top * (max_prime - 1)


def parts_are_exact(max_prime: int) -> bool:
    """Step 2a: eps = y p - v stays below 1/2 - 2**-21 for all v <= vmax."""
    eps_max = Fraction(1102, 100) * _U * parts_value_bound(max_prime)
    return eps_max < Fraction(1, 2) - Fraction(1, 2**21)


def split_value_bound(max_prime: int, split_bits: int) -> int:
    """vmax of step 1b: the largest v = hi * C + lo over hi < 2**(63-k), lo < 2**k, C <= p - 1."""
    return ((1 << (63 - split_bits)) - 1) * (max_prime - 1) + (1 << split_bits) - 1


def quotient_is_exact(vmax: int) -> bool:
    """Step 2b: the error e stays below 0.21 for all v <= vmax."""
    return 12 * (vmax + 1) < 1 << 52


def choose_split_bits(max_prime: int) -> int | None:
    """Split point k of step 1b that minimises the largest v, or None when no k keeps the
    result exact."""
    best = min(range(11, 53), key=lambda k: split_value_bound(max_prime, k))
    return best if quotient_is_exact(split_value_bound(max_prime, best)) else None


@dataclass(frozen=True)
class ExactModPlan:
    """Constants for ``out[:, g*heads + j] = mix[g] % primes[g, j] + offsets[g, j]``."""

    split_bits: int  # 16 (the parts of step 1a) or k of step 1b
    by_parts: bool  # step 1a (else 1b)
    weight: np.ndarray  # float64 [G, parts, heads]: the weights of step 2
    # (prime, offset) operands of step 3, repeated `tile` times so that `tile` rows of out
    # laid end to end meet them in one row (longer inner loops in the broadcast addcmul),
    # keyed (subnormal, tile): prime * 2**-1074 and offset * 2**-1074 (both exact subnormals),
    # or prime and 2**52 + offset (step 4).
    step3: dict[tuple[bool, int], tuple[torch.Tensor, torch.Tensor]]


def plan_exact_mod(primes: np.ndarray, offsets: np.ndarray) -> ExactModPlan | None:
    """primes, offsets: int64 [G, heads]. None when the float kernel cannot be exact."""
    pmin, pmax = int(primes.min()), int(primes.max())
    if pmin < 2 or int(offsets.max()) + pmax >= 1 << 52:
        return None
    p = primes.astype(np.float64)
    if parts_are_exact(pmax):
        k, by_parts = PART_BITS, True
        scale = 1 + 6 * _U  # 1 + d
        weight = np.array(
            [[[float((1 << s) % q * scale / q) for q in map(int, row)] for s in _PART_SHIFTS]
             for row in primes]
        )  # fmt: skip
    else:
        split = choose_split_bits(pmax)
        if split is None:
            return None
        k, by_parts = split, False
        inv = 1.0 / p
        residue = np.array([[(1 << k) % int(q) for q in row] for row in primes], dtype=np.float64)
        weight = np.stack([residue * inv, inv, 0.25 * inv], axis=1)
    p, off = p.reshape(-1), offsets.reshape(-1).astype(np.float64)
    step3 = {
        (subnormal, tile): (torch.from_numpy(np.tile(a, tile)), torch.from_numpy(np.tile(b, tile)))
        for subnormal, a, b in (
            (True, p * _SMALLEST_SUBNORMAL, off * _SMALLEST_SUBNORMAL),
            (False, p, MAGIC + off),
        )
        for tile in (1, ROW_TILE)
    }
    return ExactModPlan(split_bits=k, by_parts=by_parts, weight=weight, step3=step3)


def denormals_work() -> bool:
    """False when this thread flushes subnormals to zero (FTZ/DAZ, e.g. after
    torch.set_flush_denormal(True)): step 3 then uses the 2**52 grid (step 4)."""
    return _SMALLEST_SUBNORMAL + _ZERO != 0.0


# ATen runs an elementwise op on the calling thread up to this many elements; above it, with
# torch.get_num_threads() > 1, it forks an OpenMP team, which made hashing 4-8x slower on a busy
# 2-core machine. The torch passes are split into pieces of at most this size instead.
_ATEN_GRAIN = 32768


class _Chunk(NamedTuple):
    start: int  # rows [start, end) of out
    end: int
    gemm_in: np.ndarray  # [G, rows, parts] view of parts
    pieces: list[tuple[int, int]]  # the rows in torch calls below _ATEN_GRAIN elements


class _Workspace:
    """Buffers and views for one (groups, heads, tokens) shape: built once, reused per call
    (fresh arrays cost page faults; numpy views and torch.from_numpy ~0.5 us each)."""

    def __init__(self, groups: int, heads: int, n: int, parts: int) -> None:
        cols = groups * heads
        chunk = min(n, max(16, CHUNK_ELEMENTS // cols))
        self.parts = np.empty((groups, n, parts))  # the parts of step 1, as float64
        self.chunks: list[_Chunk] = []
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            piece = max(1, _ATEN_GRAIN // cols)
            piece = -(-(e - s) // -(-(e - s) // piece))  # balanced, still <= _ATEN_GRAIN elements
            if piece > ROW_TILE:  # whole tiles where possible (a ragged last piece is fine)
                piece -= piece % ROW_TILE
            pieces = [(a, min(e, a + piece)) for a in range(s, e, piece)]
            gemm_in = self.parts[:, s:e]
            self.chunks.append(_Chunk(s, e, gemm_in, pieces))


class _Workspaces(threading.local):
    def get(self, groups: int, heads: int, n: int, parts: int) -> _Workspace:
        cache: dict[tuple[int, ...], _Workspace] = self.__dict__.setdefault("cache", {})
        key = (groups, heads, n, parts, CHUNK_ELEMENTS)
        ws = cache.get(key)
        if ws is None:
            if len(cache) >= 4:  # shapes vary (e.g. generation): keep memory bounded
                cache.clear()
            ws = cache[key] = _Workspace(groups, heads, n, parts)
        return ws


_WORKSPACES = _Workspaces()


def _split_into(parts: np.ndarray, mix: np.ndarray, plan: ExactModPlan) -> None:
    """Step 1: float64 parts [G, ..., parts] of int64 mix [G, ...] (last axis contiguous)."""
    if plan.by_parts:
        np.copyto(parts, mix.view(np.uint16).reshape(*mix.shape, PARTS), casting="unsafe")
    else:
        np.right_shift(mix, plan.split_bits, out=parts[..., 0], casting="unsafe")
        np.bitwise_and(mix, (1 << plan.split_bits) - 1, out=parts[..., 1], casting="unsafe")
        parts[..., 2] = 1.0


def _mod_into(ws: _Workspace, plan: ExactModPlan, out: np.ndarray) -> None:
    """Steps 2-4 on ws.parts (step 1 done) into out (int64 [n, G*heads])."""
    groups, _, heads = plan.weight.shape
    out_f = out.view(np.float64)
    out_3 = out_f.reshape(out.shape[0], groups, heads)
    split_torch = torch.get_num_threads() > 1
    subnormal = denormals_work()
    tiled, untiled = plan.step3[(subnormal, ROW_TILE)], plan.step3[(subnormal, 1)]
    for chunk in ws.chunks:
        # Batched [rows, parts] @ [parts, heads] products written straight into the
        # [rows, G*heads] layout of out (G x fewer multiply-adds than one block-sparse product).
        np.matmul(chunk.gemm_in, plan.weight, out=out_3[chunk.start : chunk.end].transpose(1, 0, 2))
        for a, b in chunk.pieces if split_torch else ((chunk.start, chunk.end),):
            rows, (prime, offset) = (
                ((b - a) // ROW_TILE, tiled) if (b - a) % ROW_TILE == 0 else (b - a, untiled)
            )
            y = torch.from_numpy(out_f[a:b].reshape(rows, -1))  # cheaper than slicing a tensor
            torch.frac(y, out=y)
            torch.addcmul(offset, y, prime, out=y)
    if not subnormal:
        np.subtract(out, MAGIC_BITS, out=out)


def mod_with_offsets(mix: np.ndarray, plan: ExactModPlan, out: np.ndarray) -> None:
    """out[t, g*heads + j] = mix[g, t] % primes[g, j] + offsets[g, j] for int64 mix [G, N] >= 0.

    out: int64 [N, G*heads], C-contiguous; it doubles as the float64 buffer. Runs on the calling
    thread only; buffers are per thread."""
    groups, n = mix.shape
    ws = _WORKSPACES.get(groups, plan.weight.shape[2], n, plan.weight.shape[1])
    _split_into(ws.parts, np.ascontiguousarray(mix, dtype=np.int64), plan)
    _mod_into(ws, plan, out)


class _MixWorkspace:
    """Buffers and views of the n-gram mixing stage for one [B, T] shape.

    Rows are padded on the left and laid end to end (flat index i = b * (T + k_max) + c), so
    the token k steps back is at i - k and every product and XOR is one call over contiguous
    rows; the mixes computed at pad columns are garbage and never read."""

    def __init__(
        self, layers: int, max_ngram: int, plan: ExactModPlan, b: int, t: int, pad: int
    ) -> None:
        k_max = max_ngram - 1
        width = b * (t + k_max)
        self.padded = np.empty((b, t + k_max), dtype=np.int64)
        self.padded[:, :k_max] = pad
        self.tokens = self.padded[:, k_max:]
        self.padded_flat = self.padded.reshape(width)
        self.prods = np.empty((layers, max_ngram, width), dtype=np.int64)
        self.mix = np.empty((layers, k_max, width), dtype=np.int64)
        groups, heads, parts = layers * k_max, plan.weight.shape[2], plan.weight.shape[1]
        # [G, B, T]: the mixes at token columns, in (layer, n) group order.
        self.mix_tokens = self.mix.reshape(groups, b, t + k_max)[:, :, k_max:]
        self.mod = _Workspace(groups, heads, b * t, parts)
        self.parts = self.mod.parts.reshape(groups, b, t, parts)
        # torch's int64 ops and uint16 -> float64 cast are vectorised (numpy's are not) and cost
        # less per call; in pieces of at most _ATEN_GRAIN elements, which ATen runs on the
        # calling thread.
        prods_t, padded_t = torch.from_numpy(self.prods), torch.from_numpy(self.padded_flat)
        step = max(1, _ATEN_GRAIN // (layers * max_ngram))
        self.prod_pieces = [
            (prods_t[..., a : a + step], padded_t[a : a + step]) for a in range(0, width, step)
        ]
        # mix n = XOR of the products k = 0..n-1 steps back: (acc, term, out) in order.
        mix_t = torch.from_numpy(self.mix)
        terms = [prods_t[:, k, k_max - k : width - k] for k in range(max_ngram)]
        step = max(1, _ATEN_GRAIN // layers)
        self.xor_pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        acc = terms[0]
        for k in range(1, max_ngram):
            out = mix_t[:, k - 1, k_max:]
            self.xor_pieces += [
                (acc[:, a : a + step], terms[k][:, a : a + step], out[:, a : a + step])
                for a in range(0, width - k_max, step)
            ]
            acc = out
        self.cast_pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        if plan.by_parts:
            src = torch.from_numpy(self.mix_tokens.view(np.uint16).reshape(self.parts.shape))
            self.cast_pieces = _serial_pieces(torch.from_numpy(self.parts), src)


def _serial_pieces(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) views along the leading axes, each of at most _ATEN_GRAIN elements."""
    if dst.numel() <= _ATEN_GRAIN:
        return [(dst, src)]
    row = dst[0].numel()
    if row > _ATEN_GRAIN:
        return [piece for d, s in zip(dst, src, strict=True) for piece in _serial_pieces(d, s)]
    rows = _ATEN_GRAIN // row
    return [(dst[a : a + rows], src[a : a + rows]) for a in range(0, dst.shape[0], rows)]


class CpuNgramKernel:
    """The fast CPU path of one hasher: compress -> shifted products -> XOR mixes -> exact mod,
    on per-thread, per-shape buffers (about a dozen numpy/torch calls per batch)."""

    def __init__(
        self, multipliers: np.ndarray, lookup: np.ndarray | None, pad: int, plan: ExactModPlan
    ) -> None:
        self.multipliers = multipliers[:, :, None]  # [L, max_ngram, 1]
        self.multipliers_t = torch.from_numpy(self.multipliers)
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
            ws = cache[(b, t)] = _MixWorkspace(layers, max_ngram, self.plan, b, t, self.pad)
        return ws

    def __call__(self, ids: np.ndarray, out: np.ndarray) -> None:
        """ids: int64 [B, T] in [0, len(lookup)); out: int64 [B, T, L, H], C-contiguous."""
        b, t = ids.shape
        ws = self.workspace(b, t)
        if self.lookup is None:
            np.copyto(ws.tokens, ids)
        else:
            self.lookup.take(ids, out=ws.tokens, mode="clip")  # ids were checked by the caller
        for prods, padded in ws.prod_pieces:
            torch.mul(self.multipliers_t, padded, out=prods)  # wrapping int64
        for acc, term, mix in ws.xor_pieces:
            torch.bitwise_xor(acc, term, out=mix)
        if self.plan.by_parts:
            for parts, mix_parts in ws.cast_pieces:
                parts.copy_(mix_parts)  # step 1a
        else:
            _split_into(ws.parts, ws.mix_tokens, self.plan)
        _mod_into(ws.mod, self.plan, out.reshape(b * t, -1))  # a view: out is C-contiguous
