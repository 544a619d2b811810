"""torch.compile vs eager: train-step time of the same model, same batch, one CPU process.

    python benchmarks/bench_compile.py                      # debug and mid shapes, 2 threads
    python benchmarks/bench_compile.py --flavors debug --steps 6 --backend inductor

Both models are built, parallelized (`parallelize_model`, world size 1: the same path as the
recipe, Engram tables sharded over one rank) and initialised identically; one gets
`compile.enable = true`. Steps run interleaved (eager, compiled, eager, ...) so machine noise hits
both alike; the table reports the first compiled step (compilation) separately and medians of the
rest. Engram as in train_configs/debug_model.toml (one Engram layer, its lookup stays eager).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engram.config import load_config
from engram.data.tokenizer import load_tokenizer
from engram.models.builder import build_from_config
from engram.optim.builder import build_optimizers
from engram.runtime.distributed import init_distributed
from parallelisms.parallel_dims import parallel_dims_from_config
from parallelisms.parallelize import parallelize_model


def make_variant(flavor: str, compiled: bool, backend: str, seq: int, tokenizer):
    cfg = load_config(
        [
            "--job.config_file=train_configs/debug_model.toml",
            f"--model.flavor={flavor}",
            f"--training.seq_len={seq}",
            f"--compile.enable={compiled}",
            f"--compile.backend={backend}",
        ]
    )
    model, hasher = build_from_config(cfg, tokenizer)
    dims = parallel_dims_from_config(cfg, 1)
    dims.build_mesh("cpu")
    parallelize_model(model, cfg, dims)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model, hasher, build_optimizers(model, cfg)


def step(model, optimizers, ids, labels, hash_ids) -> tuple[float, float]:
    t0 = time.perf_counter()
    logits = model(ids, hash_ids=hash_ids)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, loss.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavors", default="debug,mid")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="timed steps after the first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    init_distributed("cpu")
    tokenizer = load_tokenizer("")
    rows = []
    for flavor in args.flavors.split(","):
        eager = make_variant(flavor, False, args.backend, args.seq, tokenizer)
        comp = make_variant(flavor, True, args.backend, args.seq, tokenizer)
        hasher = eager[1]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, tokenizer.vocab_size, (args.batch, args.seq + 1), generator=g)
        inputs, labels = ids[:, :-1], ids[:, 1:]
        hash_ids = torch.from_numpy(hasher(inputs.numpy()))
        first = {}
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        losses: dict[str, list[float]] = {"eager": [], "compiled": []}
        for i in range(args.steps + 1):
            for name, (model, _, opts) in (("eager", eager), ("compiled", comp)):
                dt, loss = step(model, opts, inputs, labels, hash_ids)
                losses[name].append(loss)
                if i == 0:
                    first[name] = dt
                else:
                    times[name].append(dt)
        e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
        n_params = sum(p.numel() for p in eager[0].parameters())
        drift = max(
            abs(a - b) / a for a, b in zip(losses["eager"], losses["compiled"], strict=True)
        )
        rows.append(
            f"| {flavor} | {n_params / 1e6:.1f} M | {args.batch} x {args.seq} | {e * 1e3:.0f} | "
            f"{c * 1e3:.0f} | {e / c:.2f} | {first['compiled']:.1f} | {drift:.1e} |"
        )
        print(rows[-1], flush=True)
    print(
        f"\n{args.backend}, {args.threads} threads, median of {args.steps} steps after the first\n"
    )
    print(
        "| shape | params | batch | eager step (ms) | compiled step (ms) | speed-up | "
        "first compiled step (s) | max loss rel. diff |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
