"""Engram's n-gram hashing: token ids -> per-head table row ids, bit-exact with the official demo.

- `ngram.py`: `NgramHasher` (tokenizer compression, multipliers from the seed, primes, offsets
  into one concatenated table) and `engram_table_rows`; the public entry point.
- `kernels.py`: the numpy / torch kernel and its exact modular-arithmetic plan.
- `native.py` + `csrc/ngram_hash.c`: the same ids from one C call (built by `pip install`;
  optional, the numpy / torch kernel is used without it).

A new hashing kernel (another device, another instruction set) goes here, and must reproduce
`kernels.py`'s ids bit for bit (tests/test_hashing.py).
"""
