"""Warn when Engram tables are so small that most n-grams share their row with another one.

Every n-gram position starts with one of `compressed_vocab` tokens, so a run sees at least that
many distinct n-grams of each order. Hashing N distinct n-grams uniformly into a head of P rows,
the fraction that shares its row with at least one other is 1 - exp(-(N - 1) / P); with
N = compressed_vocab this is a LOWER bound on the collision rate (real text has far more
distinct n-grams). Engram expects collisions (several heads disambiguate them), but when even
this bound is above one half, the tables cannot tell most n-grams apart.
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger("engram")

THRESHOLD = 0.5


def collision_rates(hasher: Any) -> dict[int, float]:
    """{n-gram order: lower bound of the per-head collision rate (smallest head of the order)}."""
    rates: dict[int, float] = {}
    heads = hasher.n_head_per_ngram
    for sizes in hasher.table_sizes.values():
        for k, n in enumerate(range(2, hasher.max_ngram + 1)):
            smallest = min(sizes[k * heads : (k + 1) * heads])
            rate = 1.0 - math.exp(-(hasher.compressed_vocab - 1) / smallest)
            rates[n] = max(rates.get(n, 0.0), rate)
    return rates


def warn_if_tables_collide(hasher: Any) -> dict[int, float]:
    """Log a warning naming engram.vocab_size_per_ngram when an order's bound exceeds 1/2."""
    rates = collision_rates(hasher)
    bad = {n: r for n, r in rates.items() if r > THRESHOLD}
    if bad:
        detail = ", ".join(f"{n}-grams >= {r:.0%}" for n, r in sorted(bad.items()))
        logger.warning(
            "Engram tables are too small for this vocabulary: at least %s of n-grams share "
            "their table row with another in every head (compressed vocabulary %d). Raise "
            "engram.vocab_size_per_ngram (one entry per order) well above %d",
            detail,
            hasher.compressed_vocab,
            hasher.compressed_vocab,
        )
    return rates
