"""The C hashing kernel (engram/hashing/csrc/ngram_hash.c), when `pip install` could build it.

Same contract and bit-exact ids as `engram.hashing.kernels.CpuNgramKernel` (whose exactness plan
it reuses), in one C call per batch instead of a dozen numpy/torch calls, with segment ids
handled in the same call. `available()` is False when the extension is missing (no C
compiler at install time): NgramHasher then uses the numpy/torch kernel.
"""

from __future__ import annotations

import numpy as np

from engram.hashing.kernels import ExactModPlan

try:
    from engram.hashing import _ngram_hash
except ImportError:  # built by setup.py; optional
    _ngram_hash = None


def available() -> bool:
    return _ngram_hash is not None


class NativeNgramKernel:
    """ids [B, T] (+ optional segment ids) -> out [B, T, L, H] with the table offsets added."""

    def __init__(
        self,
        multipliers: np.ndarray,
        lookup: np.ndarray | None,
        num_ids: int,
        pad: int,
        plan: ExactModPlan,
    ) -> None:
        if _ngram_hash is None:
            raise RuntimeError(
                "engram.hashing._ngram_hash is not built: reinstall with a C compiler"
            )
        if not plan.by_parts:
            raise ValueError("the C kernel implements the 16-bit-parts plan only")
        self.layers, self.max_ngram = multipliers.shape
        self.multipliers = np.ascontiguousarray(multipliers, dtype=np.int64)
        if lookup is not None and int(lookup.max()) >= 2**31:
            raise ValueError("compressed ids must be < 2**31 (the C kernel reads an int32 lookup)")
        self.lookup = None if lookup is None else np.ascontiguousarray(lookup, dtype=np.int32)
        self.num_ids = int(num_ids)
        self.pad = int(pad)
        self.weight = np.ascontiguousarray(plan.weight, dtype=np.float64)  # [G, 4, H]
        self.heads = self.weight.shape[2]
        prime, magic_offset = plan.step3[(False, 1)]  # prime and 2**52 + offset (step 4)
        self.prime = np.ascontiguousarray(prime.numpy())
        self.magic_offset = np.ascontiguousarray(magic_offset.numpy())

    def __call__(self, ids: np.ndarray, out: np.ndarray, seg: np.ndarray | None = None) -> bool:
        """ids: int [B, T]; seg: int [B, T] or None; out: int64 [B, T, L, H], C-contiguous.
        False (out incomplete) when an id lies outside [0, num_ids): the caller checks them."""
        b, t = ids.shape
        return -1 == _ngram_hash.hash_ngrams(
            np.ascontiguousarray(ids, dtype=np.int64),
            None if seg is None else np.ascontiguousarray(seg, dtype=np.int64),
            self.lookup, self.multipliers, self.weight, self.prime, self.magic_offset, out,
            b, t, self.layers, self.max_ngram, self.heads, self.num_ids, self.pad,
        )  # fmt: skip
