"""torch.compile vs eager: the recipe's training step, same model, same batch, one CPU process.

    python benchmarks/bench_compile.py                      # debug and mid shapes, 2 threads
    python benchmarks/bench_compile.py --flavors debug --steps 6 --backend inductor

Both variants are `train_configs/debug_model.toml` at the given flavor (Engram as there: one
Engram layer, its lookup stays eager), built with the recipe's placement (`parallelize_model`,
world size 1) and stepped by the recipe's one step (runner/trial_step.py Trial: runner/step.py
TrainStep with the recipe's loss, clip, non-finite guard, AdamW + table Adam and schedules) on
one synthetic batch; one gets `compile.enable = true`. Steps run interleaved (eager, compiled,
eager, ...) so machine noise hits both alike; the table reports the first compiled step
(compilation) separately, medians of the rest and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engram.runtime.distributed import init_distributed  # noqa: E402
from engram.runtime.logs import init_logging  # noqa: E402
from runner.trial_step import Trial, one_process_trial  # noqa: E402


def make_variant(flavor: str, compiled: bool, args) -> Trial:
    shape = [f"--model.flavor={flavor}", f"--training.seq_len={args.seq}"]
    shape.append(f"--training.local_batch_size={args.batch}")
    return one_process_trial(
        [
            "--job.config_file=train_configs/debug_model.toml",
            *shape,
            f"--compile.enable={compiled}",
            f"--compile.backend={args.backend}",
        ]
    )


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
    init_logging(init_distributed("cpu")[0])
    rows = []
    for flavor in args.flavors.split(","):
        variants = {"eager": make_variant(flavor, False, args)}
        variants["compiled"] = make_variant(flavor, True, args)
        first, times, losses = {}, {"eager": [], "compiled": []}, {"eager": [], "compiled": []}
        for i in range(args.steps + 1):
            for name, trial in variants.items():
                timed = trial.timed_step()
                losses[name].append(timed.loss)
                if i == 0:
                    first[name] = timed.wall_s
                else:
                    times[name].append(timed.wall_s)
        e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
        n_params = sum(p.numel() for p in variants["eager"].model_parts[0].parameters())
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
