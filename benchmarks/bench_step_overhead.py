"""Engram step overhead: train-step time with Engram / without, same backbone, same batch.

    python benchmarks/bench_step_overhead.py                 # debug and mid shapes, 2 threads
                                                             # Engram as in debug_model.toml
    python benchmarks/bench_step_overhead.py --flavors debug --steps 10

Both variants run interleaved in one process (A, B, A, B, ...) so machine noise hits both alike;
the table reports medians and the ratio. Hash ids are precomputed (the data loader does that in
its workers), so the step time covers the table lookup, gating, ShortConv and their backward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engram.config import config_from_dict, load_config
from engram.data.tokenizer import load_tokenizer
from engram.models.builder import build_from_config
from engram.optim.builder import build_optimizers


def make_variant(flavor: str, engram: bool, engram_cfg: dict, tokenizer, seq: int):
    cfg = config_from_dict(
        {"model": {"flavor": flavor}, "engram": {**engram_cfg, "enabled": engram}}
    )
    model, hasher = build_from_config(cfg, tokenizer, max_seq_len=seq)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model, hasher, build_optimizers(model, cfg)


def step(model, optimizers, ids, labels, hash_ids):
    t0 = time.perf_counter()
    logits = model(ids, hash_ids=hash_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavors", default="debug,mid")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer("")
    vocab = tokenizer.vocab_size
    # The Engram section of the debug recipe (one layer, 2 orders x 4 heads of 128, 40 K rows).
    engram_cfg = load_config(["--job.config_file=train_configs/debug_model.toml"]).to_dict()[
        "engram"
    ]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    rows = []
    for flavor in args.flavors.split(","):
        base, _, base_opt = make_variant(flavor, False, engram_cfg, tokenizer, args.seq)
        eng, hasher, eng_opt = make_variant(flavor, True, engram_cfg, tokenizer, args.seq)
        hash_ids = torch.from_numpy(hasher(inputs.numpy()))
        times = {"base": [], "engram": []}
        for i in range(args.steps + 2):
            tb = step(base, base_opt, inputs, labels, None)
            te = step(eng, eng_opt, inputs, labels, hash_ids)
            if i >= 2:  # warm-up
                times["base"].append(tb)
                times["engram"].append(te)
        mb, me = statistics.median(times["base"]), statistics.median(times["engram"])
        n_base = sum(p.numel() for p in base.parameters())
        n_table = sum(p.numel() for n, p in eng.named_parameters() if ".table." in n)
        n_eng = sum(p.numel() for p in eng.parameters()) - n_base
        rows.append((flavor, n_base, n_eng, n_table, mb * 1e3, me * 1e3, me / mb))
    print(
        f"batch {args.batch} x {args.seq}, {args.threads} threads, median of {args.steps} steps\n"
    )
    print(
        "| shape | backbone params | Engram params (tables) | step w/o Engram (ms) | step with Engram (ms) | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for flavor, nb, ne, nt, mb, me, r in rows:
        print(
            f"| {flavor} | {nb / 1e6:.1f} M | {ne / 1e6:.1f} M ({nt / 1e6:.1f} M) | {mb:.0f} | {me:.0f} | {r:.2f} |"
        )


if __name__ == "__main__":
    main()
