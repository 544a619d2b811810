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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = 2.0**52
MAGIC_BITS = int(np.array(MAGIC, dtype=np.float64).view(np.int64))
# Elements per chunk: below ATen's parallel grain size (32768), so torch ops always run on the
# calling thread (no OpenMP team spinning in our worker threads), and the buffer stays in L2.
CHUNK_ELEMENTS = (1 << 15) - 1


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


class _Scratch(threading.local):
    """Per-thread buffers reused across calls (fresh large arrays cost page faults and cache
    misses), with their torch views made once (torch.from_numpy costs ~0.5 us)."""

    def quotients(self, rows: int, cols: int) -> tuple[np.ndarray, torch.Tensor]:
        buf = getattr(self, "y", None)
        if buf is None or buf[0].shape[0] < rows or buf[0].shape[1] != cols:
            y = np.empty((rows, cols))
            buf = (y, torch.from_numpy(y))
            self.y = buf
        return buf

    def split(self, groups: int, n: int) -> np.ndarray:
        hl = getattr(self, "hl", None)
        if hl is None or hl.shape[0] != groups or hl.shape[2] < n:
            hl = np.empty((groups, 3, n))
            hl[:, 2] = 1.0  # the constant row of [hi, lo, 1]
            self.hl = hl
        return hl[:, :, :n]


_SCRATCH = _Scratch()
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def thread_pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of `threads` workers (recreated when the count changes)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers != threads:
            _POOL = ThreadPoolExecutor(threads, thread_name_prefix="engram-hash")
        return _POOL


def mod_with_offsets(mix: np.ndarray, plan: ExactModPlan, out: np.ndarray) -> None:
    """out[t, g*heads + j] = mix[g, t] % primes[g, j] + offsets[g, j] for int64 mix [G, N] >= 0.

    out: int64 [N, G*heads], C-contiguous; it doubles as float64 buffer. Runs on the calling
    thread; scratch buffers are per thread."""
    groups, n = mix.shape
    heads = plan.weight.shape[2]
    cols = groups * heads
    chunk = min(n, max(16, CHUNK_ELEMENTS // cols))
    hl = _SCRATCH.split(groups, n)
    np.right_shift(mix, plan.split_bits, out=hl[:, 0], casting="unsafe")
    np.bitwise_and(mix, (1 << plan.split_bits) - 1, out=hl[:, 1], casting="unsafe")
    y_buf, yt_buf = _SCRATCH.quotients(chunk, cols)
    out_t = torch.from_numpy(out.view(np.float64))
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        y, yt = y_buf[: e - s], yt_buf[: e - s]
        # Batched [n, 3] @ [3, heads] products written straight into the [n, G*heads] layout
        # (3x fewer multiply-adds than one block-sparse product).
        a = hl[:, :, s:e].transpose(0, 2, 1)
        np.matmul(a, plan.weight, out=y.reshape(e - s, groups, heads).transpose(1, 0, 2))
        torch.frac(yt, out=yt)
        torch.addcmul(plan.magic_offset, yt, plan.prime, out=out_t[s:e])
    np.subtract(out, MAGIC_BITS, out=out)
