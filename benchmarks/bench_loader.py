"""Data loader throughput per rank (tokens vs jsonl at simulated dp sizes) and prepare throughput.

    python benchmarks/bench_loader.py                   # full run (docs/benchmarks.md)
    python benchmarks/bench_loader.py --quick           # tiny smoke run

1. Loader: one process plays rank 0 and the last rank of dp = 1, 8, 64 (num_workers = 0, so the
   time is the loader's own work, including Engram hashing with the debug config's NgramHasher)
   and reports delivered tokens/s for that rank. `jsonl` tokenises the global stream in every
   rank; `tokens` (prepared shards) reads its own rows by index. Sources and dp sizes are
   interleaved, median of --repeats.
2. Prepare: tokens/s per worker of scripts/prepare_data.py's pipeline with the debug tokenizer
   (2,048 ids) and with a byte-level BPE of --bpe-vocab ids trained here on generated text.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from engram.config import config_from_dict  # noqa: E402
from engram.data.loader import build_dataloader  # noqa: E402
from engram.data.prepare import Options, prepare  # noqa: E402
from engram.data.synthetic import SyntheticFacts  # noqa: E402
from engram.data.tokenizer import load_tokenizer  # noqa: E402
from engram.hashing.ngram import NgramHasher  # noqa: E402


def write_facts(path: Path, docs: int) -> None:
    facts = SyntheticFacts(1, 512, 0, "train")
    with path.open("w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": facts[i]}) + "\n")


def write_words(path: Path, mb: float, seed: int) -> None:
    """Diverse pseudo-text (a Zipf-ish vocabulary of ~200K made-up words) for BPE training."""
    rng = random.Random(seed)
    sy = [a + b for a in "b c d f g h k l m n p r s t v w z st tr pl".split() for b in "aeiou"]
    words = ["".join(rng.choice(sy) for _ in range(rng.randint(1, 4))) for _ in range(200_000)]
    weights = [1 / (i + 10) for i in range(len(words))]
    with path.open("w") as f:
        size = 0
        while size < mb * 2**20:
            n = rng.randint(20, 200)
            text = " ".join(rng.choices(words, weights, k=n)).capitalize() + "."
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)


def train_bpe(corpus: Path, vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (json.loads(line)["text"] for line in corpus.open())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out))
    return out


def loader_rate(cfg, tok, hasher, rank: int, world: int, batches: int, min_s: float) -> float:
    """Delivered tokens/s of one rank (first batch excluded: it builds the source), over at
    least `batches` batches and `min_s` seconds."""
    loader = build_dataloader(cfg, tok, hasher, rank, world)
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    n = 0
    while n < batches or time.perf_counter() - t0 < min_s:
        batch = next(it)
        n += 1
    dt = time.perf_counter() - t0
    return n * batch["input_ids"].numel() / dt


def bench_loader(args, tmp: Path) -> list[dict]:
    tok = load_tokenizer("")
    jsonl = tmp / "facts.jsonl"
    write_facts(jsonl, args.docs)
    prepare([str(jsonl)], tmp / "facts_tokens", Options(workers=2, shard_bytes=1 << 20), False)
    base = {
        "training": {"seq_len": args.seq_len, "local_batch_size": args.batch},
        "engram": {"vocab_size_per_ngram": [40009, 40013], "n_head_per_ngram": 4},
    }
    cfgs = {
        "jsonl": config_from_dict({**base, "data": {"dataset": "jsonl", "path": str(jsonl)}}),
        "tokens": config_from_dict(
            {**base, "data": {"dataset": "tokens", "path": str(tmp / "facts_tokens")}}
        ),
    }
    hasher = NgramHasher.from_config(cfgs["jsonl"].engram, tok.hf, tok.vocab_size)
    rates: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for world in args.dp:
            for rank in sorted({0, world - 1}):
                for name, cfg in cfgs.items():
                    r = loader_rate(cfg, tok, hasher, rank, world, args.batches, args.min_s)
                    rates.setdefault((name, world, rank), []).append(r)
    rows = []
    for (name, world, rank), r in rates.items():
        rows.append({"source": name, "dp": world, "rank": rank, "tok_s": statistics.median(r)})
    return rows


def bench_prepare(args, tmp: Path) -> list[dict]:
    rows = []
    facts = tmp / "prep_facts.jsonl"
    write_facts(facts, args.prepare_docs)
    words = tmp / "words.jsonl"
    write_words(words, args.bpe_train_mb, seed=0)
    t0 = time.perf_counter()
    bpe = train_bpe(words, args.bpe_vocab, tmp / "bpe.json")
    bpe_train_s = time.perf_counter() - t0
    corpus = tmp / "prep_words.jsonl"
    write_words(corpus, facts.stat().st_size / 2**20, seed=1)
    for label, path, data in [
        ("debug (2,048)", "", facts),
        (f"BPE ({load_tokenizer(bpe).vocab_size:,})", str(bpe), corpus),
    ]:
        for workers in args.prepare_workers:
            out = tmp / f"prep_{len(rows)}"
            opts = Options(tokenizer_path=path, workers=workers, shard_bytes=256 << 10)
            t0 = time.perf_counter()
            m = prepare([str(data)], out, opts, progress=False)
            dt = time.perf_counter() - t0
            rows.append(
                {
                    "tokenizer": label,
                    "workers": workers,
                    "mb": data.stat().st_size / 2**20,
                    "tokens": m["num_tokens"],
                    "tok_s_per_worker": m["num_tokens"] / dt / workers,
                    "mb_s": data.stat().st_size / 2**20 / dt,
                }
            )
    rows.append({"bpe_train_s": bpe_train_s})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--batches", type=int, default=2, help="at least this many per measurement")
    p.add_argument("--min-s", type=float, default=1.0, help="and at least this long")
    p.add_argument("--only", choices=["loader", "prepare"], default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--docs", type=int, default=30_000)
    p.add_argument("--prepare-docs", type=int, default=20_000)
    p.add_argument("--prepare-workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--bpe-vocab", type=int, default=32_768)
    p.add_argument("--bpe-train-mb", type=float, default=8)
    args = p.parse_args()
    if args.quick:
        args.dp, args.seq_len, args.batches, args.repeats, args.min_s = [1, 4], 64, 2, 1, 0.0
        args.docs, args.prepare_docs, args.prepare_workers = 400, 200, [1]
        args.bpe_vocab, args.bpe_train_mb = 600, 0.2
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.only != "prepare":
            print_loader(args, bench_loader(args, tmp))
        if args.only != "loader":
            print_prepare(bench_prepare(args, tmp))


def print_loader(args, rows: list[dict]) -> None:
    print(
        f"\nloader: tokens/s delivered per rank (batch {args.batch} x {args.seq_len}, hashing included)"
    )
    print(
        "| source | "
        + " | ".join(f"dp {w} rank {r}" for w in args.dp for r in sorted({0, w - 1}))
        + " |"
    )
    print("| --- " * (1 + sum(len({0, w - 1}) for w in args.dp)) + "|")
    for name in ("tokens", "jsonl"):
        cells = [f"{r['tok_s']:,.0f}" for r in rows if r["source"] == name]
        print(f"| {name} | " + " | ".join(cells) + " |")


def print_prepare(prep_rows: list[dict]) -> None:
    print("\nprepare: tokens/s per worker")
    print("| tokenizer | workers | input MB | tokens | tokens/s per worker | MB/s total |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in prep_rows[:-1]:
        print(
            f"| {r['tokenizer']} | {r['workers']} | {r['mb']:.1f} | {r['tokens']:,} | "
            f"{r['tok_s_per_worker']:,.0f} | {r['mb_s']:.2f} |"
        )
    print(f"(BPE trained in {prep_rows[-1]['bpe_train_s']:.1f} s)")


if __name__ == "__main__":
    main()
