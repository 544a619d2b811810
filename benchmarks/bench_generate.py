"""Decoding speed of engram/inference/decode.py (recipes/generate.py): KV cache vs full recompute.

    PYTHONPATH=. python benchmarks/bench_generate.py [--flavor mid] [--context 1024] \
        [--new 32] [--rounds 3] [--threads 2]

The recipe's model (llama3 `--flavor`, Engram at layers 1 and 3 with paper init, the debug
tokenizer) generates `--new` greedy tokens after a `--context`-token prompt, batch 1, fp32 on
CPU, with `use_cache=True` (prefill once, then one token per step against the KV cache and
the Engram windows) and `use_cache=False` (the whole sequence every step; the path before the
cache). Rounds alternate the two, so load from other processes hits both alike; the fastest
round of each is reported. Tokens per second = new tokens / wall time including the prefill.
Both paths must produce the same tokens (checked).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.config import config_from_dict  # noqa: E402
from engram.inference import build_for_generation, generate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flavor", default="mid")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    raw = {
        "job": {"device": "cpu", "seed": 0},
        "model": {"name": "llama3", "flavor": a.flavor},
        "engram": {
            "layer_ids": [1, 3],
            "n_head_per_ngram": 4,
            "vocab_size_per_ngram": [20011, 20011],
            "n_embed_per_ngram": 128,
            "init": "paper",
        },  # fmt: skip
    }
    model, tokenizer, hasher = build_for_generation(config_from_dict(raw), a.context + a.new)
    prompt = torch.randint(
        0, tokenizer.vocab_size, (1, a.context), generator=torch.Generator().manual_seed(0)
    )
    best = {True: float("inf"), False: float("inf")}
    outs = {}
    for _ in range(a.rounds):
        for cached in (True, False):
            begin = time.perf_counter()
            outs[cached] = generate(
                model, prompt, hasher, a.new, vocab_size=tokenizer.vocab_size, use_cache=cached
            )
            best[cached] = min(best[cached], time.perf_counter() - begin)
    same = torch.equal(outs[True], outs[False])
    print(
        f"llama3/{a.flavor} + Engram, context {a.context}, {a.new} new tokens, {a.threads} threads"
    )
    print(f"| path | s per generation (best of {a.rounds}) | tokens/s |")
    print("|---|---:|---:|")
    for cached, name in ((False, "uncached (full recompute)"), (True, "KV cache")):
        print(f"| {name} | {best[cached]:.2f} | {a.new / best[cached]:.1f} |")
    print(f"speedup {best[False] / best[True]:.1f}x; same tokens: {same}")
    if not same:
        raise SystemExit("cached and uncached decoding produced different tokens")


if __name__ == "__main__":
    main()
