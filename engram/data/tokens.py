"""Sample i of a prepared token dataset (or a weighted mixture of them), computed by index.

The concatenated tokens of a prepared folder are cut into fixed chunks of seq_len + 1 tokens;
chunk c is held out (split "val") when c % P == P - 1 with P = min(100, chunks), so ~1% of the
tokens, spread evenly and disjoint from training. Every epoch visits the chunks of a split in a
seeded pseudo-random order: a keyed Feistel bijection on [0, n) (cycle-walking), evaluated per
index, so no per-chunk or per-token array is ever built. A mixture interleaves its sources in
blocks of `MIX_BLOCK` samples, each block holding round(weight * MIX_BLOCK) samples of each
source in a seeded order; so sample j's source, and its index within that source's stream, are
O(1) to compute. Every (rank, worker) therefore reads and hashes only the samples it delivers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from engram.data.shards import TokenShards

MIX_BLOCK = 4096


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def round_keys(key: list[int]) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 1 << 63, size=4, dtype=np.uint64)


def permute(index: np.ndarray, n: int, key: list[int] | np.ndarray) -> np.ndarray:
    """A seeded bijection of [0, n) applied to `index` (values in [0, n)); `key`: a seed list
    or its round_keys."""
    half = max(1, (max(1, int(n - 1).bit_length()) + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = key if isinstance(key, np.ndarray) else round_keys(key)
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():  # cycle-walk values that land outside [0, n)
        y = x[todo]
        left, right = y >> np.uint64(half), y & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        x[todo] = (left << np.uint64(half)) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


class EpochOrder:
    """Position j >= 0 -> index in [0, n): a seeded permutation of [0, n) per epoch j // n."""

    def __init__(self, n: int, key: list[int]) -> None:
        self.n = n
        self.key = key
        self._keys: tuple[int, np.ndarray] | None = None

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        epoch = positions // self.n
        out = np.empty_like(positions)
        for e in np.unique(epoch):
            sel = epoch == e
            if self._keys is None or self._keys[0] != e:
                self._keys = (int(e), round_keys([*self.key, int(e)]))
            out[sel] = permute(positions[sel] % self.n, self.n, self._keys[1])
        return out


class ChunkStream:
    """The infinite, shuffled stream of one split of one prepared folder: samples by index."""

    def __init__(self, shards: TokenShards, seq_len: int, split: str, seed: int, stream: int):
        self.shards = shards
        self.chunk = seq_len + 1
        chunks = shards.num_tokens // self.chunk
        self.period = min(100, chunks)
        held = chunks // self.period if chunks else 0
        self.size = held if split == "val" else chunks - held
        self.split = split
        self.order = EpochOrder(self.size, [seed, stream, 1 if split == "val" else 0])
        if self.size == 0 or (split == "train" and held == 0):
            raise ValueError(
                f"{shards.folder} holds {shards.num_tokens} tokens, {chunks} sequence(s) of "
                f"seq_len + 1 = {self.chunk}: too few for a {split} split (needs >= 2 sequences); "
                "prepare more text or lower training.seq_len"
            )

    def chunk_of(self, positions: np.ndarray) -> np.ndarray:
        """Chunk index of sample positions j >= 0 of this split's stream."""
        p = self.order(positions)
        if self.split == "val":
            return p * self.period + self.period - 1
        return p // (self.period - 1) * self.period + p % (self.period - 1)


class TokenMixture:
    """Weighted, deterministic mixture of prepared folders; `samples(j)` for global sample ids."""

    def __init__(
        self,
        folders: list[str],
        weights: list[float],
        fingerprint: str | None,
        vocab_size: int,
        seq_len: int,
        split: str,
        seed: int,
    ) -> None:
        self.names = _names(folders)
        self.streams = [
            ChunkStream(TokenShards(f, fingerprint, vocab_size), seq_len, split, seed, i)
            for i, f in enumerate(folders)
        ]
        self.vocab_size = vocab_size
        self.seed = seed
        w = np.asarray(weights, dtype=np.float64) / sum(weights)
        counts = np.floor(w * MIX_BLOCK).astype(np.int64)
        # largest remainder; a source of any weight > 0 gets at least one sample per block
        order = np.argsort(-(w * MIX_BLOCK - counts), kind="stable")
        counts[order[: MIX_BLOCK - counts.sum()]] += 1
        counts[counts == 0] = 1
        self.counts = counts
        self.block = int(counts.sum())
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None
        parts = [s.shards.fingerprint for s in self.streams] + [str(c) for c in counts]
        self.fingerprint = hashlib.sha256("/".join(parts).encode()).hexdigest()[:16]

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Source of each position of mixing block b, and its rank among that source's."""
        if self._cache is None or self._cache[0] != b:
            labels = np.repeat(np.arange(len(self.counts)), self.counts)
            if len(self.counts) > 1:
                labels = np.random.default_rng([self.seed, 7919, b]).permutation(labels)
            rank = np.empty_like(labels)
            for k in range(len(self.counts)):
                sel = labels == k
                rank[sel] = np.arange(int(sel.sum()))
            self._cache = (b, labels, rank)
        return self._cache[1], self._cache[2]

    def samples(self, first: int, count: int) -> list[dict[str, np.ndarray]]:
        """Global samples [first, first + count): input_ids, labels, segment_ids (int64 [T])."""
        source = np.empty(count, dtype=np.int64)
        index = np.empty(count, dtype=np.int64)  # position in its source's stream
        for i, j in enumerate(range(first, first + count)):
            b, pos = divmod(j, self.block)
            labels, rank = self._block(b)
            source[i] = labels[pos]
            index[i] = b * self.counts[source[i]] + rank[pos]
        chunks = np.empty(count, dtype=np.int64)
        for k in np.unique(source):
            chunks[source == k] = self.streams[k].chunk_of(index[source == k])
        out = []
        for k, c in zip(source.tolist(), chunks.tolist(), strict=True):
            stream = self.streams[k]
            x, seg = stream.shards.read(c * stream.chunk, (c + 1) * stream.chunk)
            if x.max() >= self.vocab_size:  # corrupt shard bytes (the header said otherwise)
                raise ValueError(
                    f"{stream.shards.folder}: token id {int(x.max())} >= vocabulary "
                    f"{self.vocab_size} in chunk {c}: the shard is corrupt; re-run prepare"
                )
            out.append({"input_ids": x[:-1], "labels": x[1:], "segment_ids": seg[:-1]})
        return out

    def samples_per_source(self, consumed: int) -> dict[str, int]:
        """How many of the first `consumed` global samples came from each source."""
        b, pos = divmod(consumed, self.block)
        labels, _ = self._block(b)
        partial = np.bincount(labels[:pos], minlength=len(self.counts))
        return {n: int(b * c + p) for n, c, p in zip(self.names, self.counts, partial, strict=True)}


def _names(folders: list[str]) -> list[str]:
    names = [Path(f).name or str(f) for f in folders]
    if len(set(names)) != len(names):  # same folder name under different parents
        names = [f"{i}_{n}" for i, n in enumerate(names)]
    return names
