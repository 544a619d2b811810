"""engram/hashing/ngram.py against an independent transcription of DeepSeek's official Engram demo.

`RefCompressedTokenizer` / `RefNgramHashMapping` below follow engram_demo_v1.py line by line
(numpy `%`, np.pad shifts, per-id decode, a naive prime search by trial division); only the
transformers AutoTokenizer is replaced by a `tokenizers.Tokenizer` built in the test.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from engram.config import Engram
from engram.hashing import kernels
from engram.hashing import native as _hash_native
from engram.hashing.ngram import (
    NgramHasher,
    build_compression_lookup,
    find_table_primes,
    is_prime,
    layer_multipliers,
)

DEBUG_TOKENIZER = (
    Path(__file__).resolve().parent.parent / "engram" / "data" / "assets" / "debug_tokenizer.json"
)

# --- reference: near-literal transcription of the demo ---------------------------------------


def ref_isprime(n: int) -> bool:
    if n < 2:
        return False
    for d in range(2, math.isqrt(n) + 1):
        if n % d == 0:
            return False
    return True


def ref_find_next_prime(start, seen_primes):
    candidate = start + 1
    while True:
        if ref_isprime(candidate) and candidate not in seen_primes:
            return candidate
        candidate += 1


class RefCompressedTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        SENTINEL = "\ue000"
        self.normalizer = normalizers.Sequence(
            [
                normalizers.NFKC(),
                normalizers.NFD(),
                normalizers.StripAccents(),
                normalizers.Lowercase(),
                normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
                normalizers.Replace(Regex(r"^ $"), SENTINEL),
                normalizers.Strip(),
                normalizers.Replace(SENTINEL, " "),
            ]
        )
        self.lookup_table, self.num_new_token = self._build_lookup_table()

    def __len__(self):
        return self.num_new_token

    def _build_lookup_table(self):
        old2new = {}
        key2new = {}
        new_tokens = []
        vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)  # len(AutoTokenizer)
        for tid in range(vocab_size):
            text = self.tokenizer.decode([tid], skip_special_tokens=False)
            if "\ufffd" in text:
                key = self.tokenizer.id_to_token(tid)  # convert_ids_to_tokens
            else:
                norm = self.normalizer.normalize_str(text)
                key = norm if norm else text
            nid = key2new.get(key)
            if nid is None:
                nid = len(new_tokens)
                key2new[key] = nid
                new_tokens.append(key)
            old2new[tid] = nid
        lookup = np.empty(vocab_size, dtype=np.int64)
        for tid in range(vocab_size):
            lookup[tid] = old2new[tid]
        return lookup, len(new_tokens)

    def __call__(self, input_ids):
        arr = np.asarray(input_ids, dtype=np.int64)
        pos_mask = arr >= 0
        out = arr.copy()
        out[pos_mask] = self.lookup_table[arr[pos_mask]]
        return out


class IdentityCompressor:
    """Stands in for CompressedTokenizer when compression is off."""

    class _Same:
        def __getitem__(self, tid):
            return tid

    def __init__(self, vocab_size):
        self.lookup_table = self._Same()
        self.vocab_size = vocab_size

    def __len__(self):
        return self.vocab_size

    def __call__(self, input_ids):
        return np.asarray(input_ids, dtype=np.int64).copy()


class RefNgramHashMapping:
    def __init__(
        self,
        engram_vocab_size,
        max_ngram_size,
        n_head_per_ngram,
        layer_ids,
        compressor,
        pad_id,
        seed,
    ):
        self.vocab_size_per_ngram = engram_vocab_size
        self.max_ngram_size = max_ngram_size
        self.n_head_per_ngram = n_head_per_ngram
        self.pad_id = pad_id
        self.layer_ids = layer_ids
        self.compressed_tokenizer = compressor
        self.tokenizer_vocab_size = len(self.compressed_tokenizer)
        if self.pad_id is not None:
            self.pad_id = int(self.compressed_tokenizer.lookup_table[self.pad_id])
        max_long = np.iinfo(np.int64).max
        M_max = int(max_long // self.tokenizer_vocab_size)
        half_bound = max(1, M_max // 2)
        PRIME_1 = 10007
        self.layer_multipliers = {}
        for layer_id in self.layer_ids:
            base_seed = int(seed + PRIME_1 * int(layer_id))
            g = np.random.default_rng(base_seed)
            r = g.integers(low=0, high=half_bound, size=(self.max_ngram_size,), dtype=np.int64)
            self.layer_multipliers[layer_id] = r * 2 + 1
        self.vocab_size_across_layers = self.calculate_vocab_size_across_layers()

    def calculate_vocab_size_across_layers(self):
        seen_primes = set()
        vocab_size_across_layers = {}
        for layer_id in self.layer_ids:
            all_ngram_vocab_sizes = []
            for ngram in range(2, self.max_ngram_size + 1):
                current_ngram_heads_sizes = []
                vocab_size = self.vocab_size_per_ngram[ngram - 2]
                current_prime_search_start = vocab_size - 1
                for _ in range(self.n_head_per_ngram):
                    found_prime = ref_find_next_prime(current_prime_search_start, seen_primes)
                    seen_primes.add(found_prime)
                    current_ngram_heads_sizes.append(found_prime)
                    current_prime_search_start = found_prime
                all_ngram_vocab_sizes.append(current_ngram_heads_sizes)
            vocab_size_across_layers[layer_id] = all_ngram_vocab_sizes
        return vocab_size_across_layers

    def _get_ngram_hashes(self, input_ids, layer_id):
        x = np.asarray(input_ids, dtype=np.int64)
        B, T = x.shape
        multipliers = self.layer_multipliers[layer_id]

        def shift_k(k):
            if k == 0:
                return x
            return np.pad(x, ((0, 0), (k, 0)), mode="constant", constant_values=self.pad_id)[:, :T]

        base_shifts = [shift_k(k) for k in range(self.max_ngram_size)]
        all_hashes = []
        for n in range(2, self.max_ngram_size + 1):
            n_gram_index = n - 2
            tokens = base_shifts[:n]
            mix = tokens[0] * multipliers[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, tokens[k] * multipliers[k])
            head_vocab_sizes = self.vocab_size_across_layers[layer_id][n_gram_index]
            for j in range(self.n_head_per_ngram):
                mod = int(head_vocab_sizes[j])
                all_hashes.append((mix % mod).astype(np.int64, copy=False))
        return np.stack(all_hashes, axis=2)

    def hash(self, input_ids):
        input_ids = self.compressed_tokenizer(input_ids)
        return {lid: self._get_ngram_hashes(input_ids, layer_id=lid) for lid in self.layer_ids}

    def hash_with_offsets(self, input_ids):
        """[B, T, L, H] with MultiHeadEmbedding's offsets added, in layer_ids order."""
        out = []
        for lid, h in self.hash(input_ids).items():
            sizes = [p for per_n in self.vocab_size_across_layers[lid] for p in per_n]
            out.append(h + np.array([0, *np.cumsum(sizes[:-1])], dtype=np.int64))
        return np.stack(out, axis=2)


# --- fixtures ---------------------------------------------------------------------------------

TRAIN_TEXTS = [
    "Hello hello HELLO world World",
    "Café café cafe naïve Naive résumé RESUME",
    "tab\tseparated  double  spaces\nnew line\r\nwindows",
    "ﬁne fine ｆｕｌｌｗｉｄｔｈ fullwidth",
    "Straße strasse ÅNGSTRÖM angstrom",
    "日本語のテキスト 中文 한국어",
    "emoji 😀 🚀 done",
]


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    """A small byte-level BPE (GPT-2 / Llama 3 style): many byte tokens decode to U+FFFD."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<pad>", "<|endoftext|>", "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXTS * 10, trainer)
    tok.add_tokens(["  ", "\t\t", "AddedWord", "addedword"])
    return tok


def random_lookup(vocab: int, compressed: int, seed: int) -> np.ndarray:
    """A surjective many-to-one lookup numbered in first-seen order, like the real ones."""
    raw = np.random.default_rng(seed).integers(0, compressed, size=vocab)
    raw[:compressed] = np.arange(compressed)
    _, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))
    return rank[inverse].astype(np.int64)


def make_pair(*, vocab, lookup, layer_ids, max_ngram, heads, sizes, seed, pad_id, kernel="auto"):
    compressor = IdentityCompressor(vocab) if lookup is None else RefLookupCompressor(lookup)
    ref = RefNgramHashMapping(sizes, max_ngram, heads, layer_ids, compressor, pad_id, seed)
    ours = NgramHasher(
        layer_ids=layer_ids,
        max_ngram=max_ngram,
        n_head_per_ngram=heads,
        vocab_size_per_ngram=sizes,
        seed=seed,
        pad_id=pad_id,
        lookup=lookup,
        vocab_size=vocab,
        kernel=kernel,
    )
    return ref, ours


class RefLookupCompressor(RefCompressedTokenizer):
    """The demo's CompressedTokenizer with a given lookup table (no tokenizer needed)."""

    def __init__(self, lookup):
        self.lookup_table = lookup
        self.num_new_token = int(lookup.max()) + 1


# --- compression ------------------------------------------------------------------------------


def test_compression_matches_reference_on_bpe_tokenizer(bpe_tokenizer):
    ref = RefCompressedTokenizer(bpe_tokenizer)
    lookup, compressed = build_compression_lookup(bpe_tokenizer)
    assert lookup.dtype == np.int64
    assert lookup.shape == (bpe_tokenizer.get_vocab_size(with_added_tokens=True),)
    assert compressed == len(ref)
    assert np.array_equal(lookup, ref.lookup_table)
    # The fixture exercises every branch: merges happen and U+FFFD tokens exist.
    texts = [bpe_tokenizer.decode([i], skip_special_tokens=False) for i in range(lookup.size)]
    assert compressed < lookup.size
    assert sum("\ufffd" in t for t in texts) > 10
    same = [("Hello", "hello"), ("AddedWord", "addedword"), ("  ", "\t\t")]
    for a, b in same:
        assert lookup[bpe_tokenizer.token_to_id(a)] == lookup[bpe_tokenizer.token_to_id(b)], (a, b)


def test_compression_groups_on_word_level_tokenizer():
    """Hand-derived groups of the demo's normaliser (independent of any implementation)."""
    words = [
        "[PAD]", "Hello", "hello", "HELLO", "café", "cafe", "Café", " ", "  ", "\t", "\n", "\r\n",
        "a b", "a  b", "a\tb", "ﬁ", "fi", "ｆｉ", " x", "x ", "x", "Ångström", "angstrom", "ß", "ss",
    ]  # fmt: skip
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[PAD]"))
    lookup, compressed = build_compression_lookup(tok)
    expected_groups = [
        ["[PAD]"], ["Hello", "hello", "HELLO"], ["café", "cafe", "Café"],
        [" ", "  ", "\t", "\n", "\r\n"], ["a b", "a  b", "a\tb"], ["ﬁ", "fi", "ｆｉ"],
        [" x", "x ", "x"], ["Ångström", "angstrom"], ["ß"], ["ss"],
    ]  # fmt: skip
    assert compressed == len(expected_groups)
    for new_id, group in enumerate(expected_groups):  # first-seen numbering
        assert {int(lookup[words.index(w)]) for w in group} == {new_id}, group


@pytest.mark.skipif(not DEBUG_TOKENIZER.is_file(), reason="debug tokenizer asset not present")
def test_compression_matches_reference_on_debug_tokenizer():
    tok = Tokenizer.from_file(str(DEBUG_TOKENIZER))
    ref = RefCompressedTokenizer(tok)
    lookup, compressed = build_compression_lookup(tok)
    assert compressed == len(ref)
    assert np.array_equal(lookup, ref.lookup_table)


# --- primes and multipliers -------------------------------------------------------------------


def test_is_prime_against_trial_division():
    assert [n for n in range(-5, 5000) if is_prime(n)] == [
        n for n in range(-5, 5000) if ref_isprime(n)
    ]
    rng = np.random.default_rng(0)
    for n in rng.integers(10**6, 10**9, size=300):
        assert is_prime(int(n)) == ref_isprime(int(n))
    # Strong pseudoprimes to several small bases, Carmichael numbers, big primes.
    for n in (
        2047,
        1373653,
        25326001,
        3215031751,
        2152302898747,
        3474749660383,
        341550071728321,
        561,
        41041,
    ):
        assert not is_prime(n), n
    for n in (2**31 - 1, 2**61 - 1, 2**63 - 25, 2**64 - 59, 1_000_000_007):
        assert is_prime(n), n
    assert not is_prime((2**31 - 1) * (2**31 - 19))


@pytest.mark.parametrize(
    "sizes,layer_ids,max_ngram,heads",
    [
        ([646400, 646400], [1, 15], 3, 8),
        ([2, 2, 2], [0, 3, 1], 4, 3),
        ([10, 1], [5], 3, 4),
        ([100], [2, 1, 0], 2, 5),
        ([50, 40], [0, 1], 3, 2),
    ],
)
def test_table_primes_match_reference(sizes, layer_ids, max_ngram, heads):
    ref = RefNgramHashMapping(sizes, max_ngram, heads, layer_ids, IdentityCompressor(10), 0, 0)
    ours = find_table_primes(sizes, layer_ids, max_ngram, heads)
    assert list(ours) == layer_ids
    for lid in layer_ids:
        assert ours[lid] == [p for per_n in ref.vocab_size_across_layers[lid] for p in per_n]
    flat = [p for v in ours.values() for p in v]
    assert len(set(flat)) == len(flat)


@pytest.mark.parametrize(
    "seed,layer_id,vocab", [(0, 1, 129280), (7, 15, 3), (123, 0, 1), (5, 29, 2**40)]
)
def test_multipliers_match_reference(seed, layer_id, vocab):
    ref = RefNgramHashMapping([10, 10], 3, 1, [layer_id], IdentityCompressor(vocab), 0, seed)
    assert np.array_equal(
        layer_multipliers(seed, layer_id, 3, vocab), ref.layer_multipliers[layer_id]
    )


# --- hashing ------------------------------------------------------------------------------------


@pytest.fixture(params=["native", "python"])
def kernel(request):
    """Both CPU kernels: the C one (engram/hashing/csrc/ngram_hash.c) and the numpy/torch fallback."""
    if request.param == "native" and not _hash_native.available():
        pytest.skip("C kernel not built (test_native_kernel_is_built fails with the fix)")
    return request.param


def test_native_kernel_is_built():
    assert _hash_native.available(), (
        "engram.hashing._ngram_hash is missing: `pip install -e .` builds it from engram/hashing/csrc/ngram_hash.c "
        "with the machine's C compiler (install gcc, then reinstall)"
    )
    hasher = NgramHasher(
        layer_ids=[1], max_ngram=3, n_head_per_ngram=8, vocab_size_per_ngram=[646400, 646400], seed=0,
        pad_id=0, lookup=None, vocab_size=1000,
    )  # fmt: skip
    assert hasher.kernel_name == "native"


CASES = [
    # vocab, compressed (None: no compression), layer_ids, max_ngram, heads, sizes, seed, pad, B, T
    (129280, 100000, [1, 15], 3, 8, [646400, 646400], 0, 2, 4, 64),
    (129280, None, [1, 15], 3, 8, [646400, 646400], 0, 2, 2, 33),
    (5000, 1700, [0, 2, 5], 4, 4, [997, 50, 7], 3, 17, 3, 40),
    (300, None, [3], 2, 6, [11], 42, 0, 5, 9),
    (1000, 400, [2, 0], 3, 2, [3, 2], 1, 999, 1, 1),
    (1000, 400, [2, 0], 3, 2, [3, 2], 1, 5, 2, 2),  # T < max_ngram
    (64, 10, [7], 4, 3, [5, 5, 5], 9, 63, 1, 3),
    (50000, None, [1], 3, 8, [2**31, 2**30], 11, 4, 2, 30),  # large tables, still float path
    (50000, 30000, [0], 3, 2, [2**32, 2**32 + 2**30], 2, 4, 2, 30),  # > 2**31.8: `%` fallback
]


@pytest.mark.parametrize("case", CASES)
def test_hasher_matches_reference(case, kernel):
    vocab, compressed, layer_ids, max_ngram, heads, sizes, seed, pad, b, t = case
    lookup = None if compressed is None else random_lookup(vocab, compressed, seed)
    expect_fast = max(sizes) <= 2**31  # the exact-float kernel's limit is ~2**31.8
    ref, ours = make_pair(
        vocab=vocab,
        lookup=lookup,
        layer_ids=layer_ids,
        max_ngram=max_ngram,
        heads=heads,
        sizes=sizes,
        seed=seed,
        pad_id=pad,
        kernel=kernel if expect_fast else "auto",
    )
    assert ours.num_heads == (max_ngram - 1) * heads
    assert (ours._plan is not None) == expect_fast
    assert ours.kernel_name == (kernel if expect_fast else "numpy-mod")
    rng = np.random.default_rng(seed + 100)
    ids = rng.integers(0, vocab, size=(b, t))
    ids[:, ::5] = pad  # pad tokens inside the sequence hash like any token
    got = ours(ids)
    assert got.dtype == np.int64 and got.shape == (b, t, len(layer_ids), ours.num_heads)
    assert np.array_equal(got, ref.hash_with_offsets(ids))
    assert np.array_equal(ours.hash_torch(torch.from_numpy(ids)).numpy(), got)
    assert np.array_equal(ours._hash_torch_ops(torch.from_numpy(ids), None).numpy(), got)
    for lid in layer_ids:
        sizes_flat = [p for per_n in ref.vocab_size_across_layers[lid] for p in per_n]
        assert ours.table_sizes[lid] == sizes_flat
        assert ours.table_rows[lid] == sum(sizes_flat)
    # Row ids stay inside each head's slice of the layer's table.
    for li, lid in enumerate(layer_ids):
        lo = ours.offsets[lid]
        assert np.all(got[:, :, li] >= lo) and np.all(
            got[:, :, li] < lo + np.array(ours.table_sizes[lid])
        )


def test_hasher_with_real_tokenizer_and_negative_ids(bpe_tokenizer, kernel):
    lookup, _ = build_compression_lookup(bpe_tokenizer)
    vocab = lookup.size
    pad = bpe_tokenizer.token_to_id("<pad>")
    ref = RefNgramHashMapping(
        [1000, 1200], 3, 4, [1, 4], RefCompressedTokenizer(bpe_tokenizer), pad, 0
    )
    ours = NgramHasher(
        layer_ids=[1, 4], max_ngram=3, n_head_per_ngram=4, vocab_size_per_ngram=[1000, 1200], seed=0,
        pad_id=pad, lookup=lookup, vocab_size=vocab, kernel=kernel,
    )  # fmt: skip
    ids = np.array([bpe_tokenizer.encode(" ".join(TRAIN_TEXTS)).ids[:200]])
    assert np.array_equal(ours(ids), ref.hash_with_offsets(ids))
    ids[0, 3:7] = -100  # the demo passes negative ids through compression unchanged
    assert np.array_equal(ours(ids), ref.hash_with_offsets(ids))
    assert np.array_equal(ours._hash_torch_ops(torch.from_numpy(ids), None).numpy(), ours(ids))


def wrap64(v: int) -> int:
    return (v + 2**63) % 2**64 - 2**63


def naive_segment_hash(hasher: NgramHasher, ids: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Per-position Python-int loop: look-back stops at pad and at segment changes."""
    lookup = hasher.lookup if hasher.lookup is not None else np.arange(hasher.num_ids)
    pad = int(lookup[hasher.pad_id])
    b, t = ids.shape
    out = np.zeros((b, t, len(hasher.layer_ids), hasher.num_heads), dtype=np.int64)
    for bi in range(b):
        for ti in range(t):
            for li, lid in enumerate(hasher.layer_ids):
                m = [int(v) for v in hasher.multipliers[li]]
                col = 0
                for n in range(2, hasher.max_ngram + 1):
                    mix = 0
                    for k in range(n):
                        src = ti - k
                        same = src >= 0 and seg[bi, src] == seg[bi, ti]
                        tok = int(lookup[ids[bi, src]]) if same else pad
                        mix ^= wrap64(tok * m[k])
                    for _ in range(hasher.n_head_per_ngram):
                        p = hasher.table_sizes[lid][col]
                        out[bi, ti, li, col] = mix % p + hasher.offsets[lid][col]
                        col += 1
    return out


@pytest.mark.parametrize("compressed", [None, 300])
def test_segment_ids_stop_ngrams_at_document_boundaries(compressed, kernel):
    vocab = 1000
    lookup = None if compressed is None else random_lookup(vocab, compressed, 1)
    hasher = NgramHasher(
        layer_ids=[3, 1], max_ngram=4, n_head_per_ngram=3, vocab_size_per_ngram=[701, 2000, 97], seed=5,
        pad_id=7, lookup=lookup, vocab_size=vocab, kernel=kernel,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    ids = rng.integers(0, vocab, size=(3, 23))
    seg = np.cumsum(rng.random((3, 23)) < 0.25, axis=1)
    seg[2] = 4  # one row without boundaries
    expected = naive_segment_hash(hasher, ids, seg)
    assert np.array_equal(hasher(ids, seg), expected)
    assert np.array_equal(
        hasher.hash_torch(torch.from_numpy(ids), torch.from_numpy(seg)).numpy(), expected
    )
    assert np.array_equal(
        hasher._hash_torch_ops(torch.from_numpy(ids), torch.from_numpy(seg)).numpy(), expected
    )
    # A single segment is the reference behaviour; boundaries do change the ids.
    assert np.array_equal(hasher(ids[2:]), expected[2:])
    assert not np.array_equal(hasher(ids[:2]), expected[:2])


# --- exact float modulo -------------------------------------------------------------------------


def adversarial_mixes(primes: list[int], split_bits: int, rng: np.random.Generator) -> np.ndarray:
    """Non-negative int64 mixes at the extremes and at v = hi * C + lo near multiples of p."""
    top, k = 2**63 - 1, split_bits
    vals = [0, 1, 2, top, top - 1, 2**62, 2**53, 2**53 + 1, 2**32 - 1, 2**k, 2**k - 1]
    for p in primes:
        last = (top // p) * p
        vals += [p - 1, p, p + 1, 2 * p - 1, last, last - 1, last + p - 1]
        c = (1 << k) % p
        for hi in (top >> k, (top >> k) - 1, (top >> k) // 2, 1):
            base = (-hi * c) % p  # the smallest lo with v = hi*C + lo = 0 (mod p)
            highest = base + ((1 << k) - 1 - base) // p * p  # the largest such lo
            for lo in (base, base - 1, base + p - 1, highest, highest - 1, highest + 1):
                if 0 <= lo < 1 << k:
                    vals.append((hi << k) | lo)
    vals += [int(v) for v in rng.integers(0, top, size=4000, dtype=np.int64, endpoint=True)]
    vals += [int(v) for v in rng.integers(0, 2**40, size=500, dtype=np.int64)]
    return np.array([v for v in vals if 0 <= v <= top], dtype=np.int64)


def largest_fast_prime() -> int:
    lo, hi = 2, 2**45  # choose_split_bits is monotone in the prime
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kernels.choose_split_bits(mid) is not None else (lo, mid)
    p = lo
    while not is_prime(p):
        p -= 1
    return p


@pytest.mark.parametrize("chunk_elements", [1 << 16, 100])
@pytest.mark.parametrize(
    "primes",
    [
        [[646403, 646411, 646421], [646423, 646433, 646453]],
        [[2, 3, 5], [7, 11, 13]],
        [[1_000_000_007, 2_147_483_647, 65537], [257, 3_000_000_019, 3]],
        "largest",
    ],
)
def test_exact_mod_matches_numpy_mod(primes, chunk_elements, monkeypatch):
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", chunk_elements)
    if primes == "largest":
        p = largest_fast_prime()
        assert kernels.choose_split_bits(p) is not None and p > 2**31
        primes = [[p, 1_000_003], [999_983, p]]
    primes = np.array(primes, dtype=np.int64)
    rng = np.random.default_rng(int(primes.sum() % 1000))
    offsets = rng.integers(0, 2**40, size=primes.shape).astype(np.int64)
    plan = kernels.plan_exact_mod(primes, offsets)
    assert plan is not None
    rows = [adversarial_mixes([int(p) for p in row], plan.split_bits, rng) for row in primes]
    n = max(len(r) for r in rows)  # pad short rows with random values; keep every extreme
    fill = [rng.integers(0, 2**63 - 1, size=n - len(r), dtype=np.int64) for r in rows]
    mix = np.stack([np.concatenate([r, f]) for r, f in zip(rows, fill, strict=True)])
    assert mix.min() >= 0
    # Whole ROW_TILE-row tiles and a ragged remainder take different step-3 operands.
    for rows in (n - n % kernels.ROW_TILE, n - n % kernels.ROW_TILE - 3):
        out = np.empty((rows, primes.size), dtype=np.int64)
        kernels.mod_with_offsets(np.ascontiguousarray(mix[:, :rows]), plan, out)
        expected = (mix[:, :rows].T[:, :, None] % primes[None] + offsets[None]).reshape(rows, -1)
        assert np.array_equal(out, expected)


def test_exact_mod_rejects_unsafe_primes():
    assert kernels.choose_split_bits(2**32) is None
    no_offsets = np.zeros((1, 1), dtype=np.int64)
    assert kernels.plan_exact_mod(np.array([[2**32 + 15]]), no_offsets) is None
    assert kernels.plan_exact_mod(np.array([[646403]]), np.array([[2**52]])) is None


def test_chunking_and_torch_threads_do_not_change_ids():
    hasher = NgramHasher(
        layer_ids=[1, 15], max_ngram=3, n_head_per_ngram=8, vocab_size_per_ngram=[646400, 646400], seed=0,
        pad_id=2, lookup=None, vocab_size=129280, kernel="python",
    )  # fmt: skip
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 129280, size=(5, 3000))  # 3 rows per thread: several chunks each
    seg = np.cumsum(rng.random((5, 3000)) < 0.01, axis=1)
    ref = RefNgramHashMapping([646400, 646400], 3, 8, [1, 15], IdentityCompressor(129280), 2, 0)
    prev = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((hasher(ids), hasher(ids, seg)))
    finally:
        torch.set_num_threads(prev)
    assert np.array_equal(results[0][0], ref.hash_with_offsets(ids))
    assert np.array_equal(results[1][0], results[0][0])
    assert np.array_equal(results[1][1], results[0][1])
    if _hash_native.available():  # the C kernel on the same 15,000 tokens, with segments too
        native = NgramHasher(
            layer_ids=[1, 15], max_ngram=3, n_head_per_ngram=8, vocab_size_per_ngram=[646400, 646400],
            seed=0, pad_id=2, lookup=None, vocab_size=129280, kernel="native",
        )  # fmt: skip
        assert np.array_equal(native(ids), results[0][0])
        assert np.array_equal(native(ids, seg), results[0][1])


def test_without_the_c_kernel_auto_falls_back(monkeypatch):
    """A machine without a C compiler at install time: same ids from the numpy/torch kernel."""
    args = dict(
        layer_ids=[1], max_ngram=3, n_head_per_ngram=8, vocab_size_per_ngram=[646400, 646400], seed=0,
        pad_id=0, lookup=None, vocab_size=1000,
    )  # fmt: skip
    ids = np.random.default_rng(0).integers(0, 1000, size=(2, 50))
    expected = NgramHasher(**args, kernel="python")(ids)
    monkeypatch.setattr(_hash_native, "_ngram_hash", None)
    hasher = NgramHasher(**args)
    assert hasher.kernel_name == "python"
    assert np.array_equal(hasher(ids), expected)
    with pytest.raises(RuntimeError, match="not built: reinstall with a C compiler"):
        NgramHasher(**args, kernel="native")


def test_native_kernel_checks_its_buffers():
    """The C entry point validates buffer sizes (a guard against memory errors) and reports the
    first id outside [0, num_ids) without reading the table with it."""
    if not _hash_native.available():
        pytest.skip("C kernel not built (test_native_kernel_is_built fails with the fix)")
    hasher = NgramHasher(
        layer_ids=[1], max_ngram=3, n_head_per_ngram=2, vocab_size_per_ngram=[11, 13], seed=0, pad_id=0,
        lookup=None, vocab_size=50, kernel="native",
    )  # fmt: skip
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    with pytest.raises(ValueError, match="out: expected 12 8-byte items"):
        hasher._native(ids, np.empty((1, 3, 1, 3), dtype=np.int64))
    out = np.empty((1, 3, 1, 4), dtype=np.int64)
    assert hasher._native(ids, out)
    for bad in (50, -1):  # reported, not read: the caller raises or takes the negative-id path
        assert not hasher._native(np.array([[1, bad, 3]]), out)
    with pytest.raises(ValueError, match="kernel must be"):
        NgramHasher(
            layer_ids=[1], max_ngram=3, n_head_per_ngram=2, vocab_size_per_ngram=[11, 13], seed=0,
            pad_id=0, lookup=None, vocab_size=50, kernel="c",
        )  # fmt: skip
    with pytest.raises(ValueError, match="kernel='native' needs table primes"):
        NgramHasher(
            layer_ids=[1], max_ngram=2, n_head_per_ngram=1, vocab_size_per_ngram=[2**32], seed=0,
            pad_id=0, lookup=None, vocab_size=50, kernel="native",
        )  # fmt: skip


def test_shape_changes_and_pickling_keep_ids(kernel):
    """Per-shape buffers are cached per thread; the hasher pickles for spawned loader workers."""
    lookup = random_lookup(3000, 1000, 2)
    hasher = NgramHasher(
        layer_ids=[4, 2], max_ngram=3, n_head_per_ngram=4, vocab_size_per_ngram=[500, 700], seed=1,
        pad_id=9, lookup=lookup, vocab_size=3000, kernel=kernel,
    )  # fmt: skip
    ref = RefNgramHashMapping([500, 700], 3, 4, [4, 2], RefLookupCompressor(lookup), 9, 1)
    rng = np.random.default_rng(5)
    batches = [
        rng.integers(0, 3000, size=shape)
        for shape in [(2, 7), (3, 50), (2, 7), (1, 2), (6, 9), (3, 50)]
    ]
    for ids in batches:
        assert np.array_equal(hasher(ids), ref.hash_with_offsets(ids))
    clone = pickle.loads(pickle.dumps(hasher))
    for ids in batches[:3]:
        assert np.array_equal(clone(ids), ref.hash_with_offsets(ids))


# --- config and validation ----------------------------------------------------------------------


def engram_cfg(**kw):
    base = dict(
        layer_ids=[1, 3], max_ngram=3, n_head_per_ngram=2, vocab_size_per_ngram=[101, 103], n_embed_per_ngram=8,
        seed=4, pad_id=0, compress_tokenizer=True, respect_doc_boundaries=False,
    )  # fmt: skip
    base.update(kw)
    return Engram(**base)


def test_from_config(bpe_tokenizer):
    vocab = bpe_tokenizer.get_vocab_size(with_added_tokens=True)
    h = NgramHasher.from_config(engram_cfg(), bpe_tokenizer, vocab)
    ref = RefNgramHashMapping([101, 103], 3, 2, [1, 3], RefCompressedTokenizer(bpe_tokenizer), 0, 4)
    ids = np.random.default_rng(0).integers(0, vocab, size=(2, 20))
    assert np.array_equal(h(ids), ref.hash_with_offsets(ids))
    assert h.compressed_vocab == ref.tokenizer_vocab_size < vocab
    plain = NgramHasher.from_config(engram_cfg(compress_tokenizer=False), None, vocab)
    assert plain.lookup is None and plain.compressed_vocab == vocab
    # pad_id -1: the tokenizer wrapper's pad id (engram/data/tokenizer.py), or its lookup by name.
    wrapped = SimpleNamespace(hf=bpe_tokenizer, pad_id=bpe_tokenizer.token_to_id("<pad>"))
    assert NgramHasher.from_config(engram_cfg(pad_id=-1), wrapped, vocab).pad_id == wrapped.pad_id
    with pytest.raises(ValueError, match="compress_tokenizer"):
        NgramHasher.from_config(engram_cfg(), None, vocab)
    with pytest.raises(ValueError, match="pad_id"):
        NgramHasher.from_config(engram_cfg(pad_id=-1, compress_tokenizer=False), None, vocab)


def test_bad_input_errors(kernel):
    ok = dict(
        layer_ids=[1], max_ngram=3, n_head_per_ngram=2, vocab_size_per_ngram=[11, 13], seed=0, pad_id=0,
        lookup=None, vocab_size=50,
    )  # fmt: skip
    for bad, match in [
        (dict(max_ngram=1, vocab_size_per_ngram=[]), "max_ngram must be >= 2"),
        (dict(vocab_size_per_ngram=[11]), "one entry per order"),
        (dict(vocab_size_per_ngram=[11, 0]), "must be > 0"),
        (dict(pad_id=50), "pad_id 50 is outside"),
        (dict(pad_id=-1), "pad_id -1 is outside"),
        (dict(layer_ids=[]), "layer_ids is empty"),
        (dict(layer_ids=[1, 1]), "duplicates"),
    ]:
        with pytest.raises(ValueError, match=match):
            NgramHasher(**{**ok, **bad})
    with pytest.raises(ValueError, match="max_ngram must be >= 2"):
        find_table_primes([], [0], 1, 2)
    h = NgramHasher(**ok, kernel=kernel)
    with pytest.raises(ValueError, match="input id 50 >= 50"):
        h(np.array([[1, 50]]))
    with pytest.raises(ValueError, match="input id 50 >= 50"):
        h.hash_torch(torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match="input id 50 >= 50"):
        h._hash_torch_ops(torch.tensor([[1, 50]]), None)
    with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
        h(np.array([1, 2]))
    with pytest.raises(ValueError, match="segment_ids shape"):
        h(np.array([[1, 2]]), np.array([[0, 0, 0]]))
    with pytest.raises(ValueError, match="integers"):
        h(np.array([[1.0, 2.0]]))
    # Empty batches are valid and give empty ids.
    assert h(np.zeros((0, 5), dtype=np.int64)).shape == (0, 5, 1, 4)
    assert h(np.zeros((3, 0), dtype=np.int32)).shape == (3, 0, 1, 4)
    assert h.hash_torch(torch.zeros((2, 0), dtype=torch.long)).shape == (2, 0, 1, 4)


def test_flush_denormal_fallback_keeps_ids(kernel):
    """The fast kernel writes ids through subnormal doubles; with flush-to-zero on it must detect
    that and fall back to the 2**52 path, still bit-exact."""
    from engram.hashing.kernels import denormals_work

    hasher = NgramHasher(
        layer_ids=[1, 15], max_ngram=3, n_head_per_ngram=8, vocab_size_per_ngram=[646400, 646400], seed=0,
        pad_id=2, lookup=None, vocab_size=129280, kernel=kernel,
    )  # fmt: skip
    ids = np.random.default_rng(1).integers(0, 129280, size=(4, 257))
    ref = RefNgramHashMapping([646400, 646400], 3, 8, [1, 15], IdentityCompressor(129280), 2, 0)
    assert denormals_work()
    torch.set_flush_denormal(True)
    try:
        assert not denormals_work(), (
            "flush-to-zero did not take effect: the test would prove nothing"
        )
        got = hasher(ids)
    finally:
        torch.set_flush_denormal(False)
    assert np.array_equal(got, ref.hash_with_offsets(ids))


def test_hashing_benchmark_runs():
    """benchmarks/bench_hashing.py stays runnable (tiny workload, no engram-peft venv)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_hashing.py"
    args = ["--tokens", "2048", "--rounds", "1", "--passes", "1", "--shapes", "2x64", "1x100"]
    res = subprocess.run(
        [sys.executable, str(script), *args, "--threads", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "| 1 | 2 x 64 |" in res.stdout and "| 1 | 1 x 100 |" in res.stdout
