"""Chunked output head + cross-entropy (training.loss_chunks): peak memory and step time.

    python benchmarks/bench_chunked_loss.py                     # seq 4096, chunks 1 and 8
    python benchmarks/bench_chunked_loss.py --seq 8192 --rounds 2

A debug-width model (dim 256, 2 layers, no Engram) with Qwen2.5's 152,064-entry vocabulary, one
sequence of `--seq` tokens. Every measurement runs in a fresh subprocess (the process
high-water mark, ru_maxrss, belongs to one step): build the model, then one training step
(forward, loss, backward), peak RSS minus the RSS just before the step. The loss path's peak is
that minus the same step's peak with a loss on the hidden states instead of the head (the
backbone's share). Step time: median of `--steps` further steps (forward + loss + backward) in
the same subprocess, as process CPU time (user + system: page faults count; one thread, so it is
the work done, not the share of a shared machine the process got). Variants run interleaved, `--rounds` times, so machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

VOCAB = 152064


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure(mode: str, seq: int, steps: int, threads: int) -> dict:
    """One subprocess's measurement; mode: 'backbone' or a chunk count."""
    import torch

    from engram.models.args import ModelArgs
    from engram.models.transformer import Transformer
    from engram.train.loss import build_loss

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    args = ModelArgs(
        dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=VOCAB,
        max_seq_len=seq,
    )  # fmt: skip
    model = Transformer(args)
    model.init_weights(seed=0)
    ids = torch.randint(0, VOCAB, (1, seq))
    labels = ids.roll(-1, 1)
    if mode == "backbone":
        model.set_hidden_output(True)

        def loss_of(out, labels, divisor):
            return out.float().pow(2).mean()
    else:
        loss_of = build_loss(int(mode), [model], sharded_logits=False)

    def step() -> float:
        t0 = time.process_time()
        loss = loss_of(model(ids), labels, labels.numel())  # every position is a target
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.process_time() - t0

    before = rss_bytes()
    step()
    peak = peak_rss_bytes() - before
    times = [step() for _ in range(steps)]
    return {"mode": mode, "peak": peak, "time": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--chunks", type=int, nargs="+", default=[8])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", default="")
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(a.child, a.seq, a.steps, a.threads)))
        return
    modes = ["backbone", "1", *map(str, a.chunks)]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(a.rounds):
        for m in modes:
            cmd = [sys.executable, __file__, "--child", m, "--seq", str(a.seq)]
            cmd += ["--steps", str(a.steps), "--threads", str(a.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[m].append(json.loads(out.strip().splitlines()[-1]))
    gib = 2**30
    backbone = min(r["peak"] for r in runs["backbone"])
    ref_time = statistics.median(r["time"] for r in runs["1"])
    ref_loss_path = min(r["peak"] for r in runs["1"]) - backbone
    print(
        f"seq {a.seq}, vocab {VOCAB}, dim 256, 2 layers, {a.threads} thread(s), {a.rounds} rounds"
    )
    print(
        "| loss_chunks | step peak (GiB) | loss-path peak (GiB) | vs 1 | step CPU time (s) | vs 1 |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for m in modes[1:]:
        peak = min(r["peak"] for r in runs[m])
        t = statistics.median(r["time"] for r in runs[m])
        loss_path = peak - backbone
        print(
            f"| {m} | {peak / gib:.2f} | {loss_path / gib:.2f} | {loss_path / ref_loss_path:.3f} "
            f"| {t:.3f} | {t / ref_time:.3f} |"
        )
    print(f"backbone-only step peak: {backbone / gib:.2f} GiB")


if __name__ == "__main__":
    main()
