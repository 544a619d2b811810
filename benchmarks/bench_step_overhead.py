"""Engram step overhead: the recipe's training step with Engram / without, same backbone and batch.

    python benchmarks/bench_step_overhead.py                 # debug and mid shapes, 2 threads
                                                             # Engram as in debug_model.toml
    python benchmarks/bench_step_overhead.py --flavors debug --steps 10

Both variants are `train_configs/debug_model.toml` at the given flavor, one with
`engram.enabled = false`, built with the recipe's placement and stepped by the recipe's one step
(runner/trial_step.py Trial: runner/step.py TrainStep with the recipe's loss, clip, non-finite
guard, AdamW + table Adam and schedules) on one synthetic batch. They run interleaved in one
process (A, B, A, B, ...) so machine noise hits both alike; the table reports medians and the
ratio. Hash ids come with the batch (the data loader computes them in its workers), so the step
time covers the table lookup, gating, ShortConv, their backward and the tables' update.
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

WARMUP = 2


def make_variant(flavor: str, engram: bool, args) -> Trial:
    shape = [f"--model.flavor={flavor}", f"--training.seq_len={args.seq}"]
    shape.append(f"--training.local_batch_size={args.batch}")
    return one_process_trial(
        ["--job.config_file=train_configs/debug_model.toml", *shape, f"--engram.enabled={engram}"]
    )


def _params(trial: Trial, tables: bool = False) -> int:
    named = trial.model_parts[0].named_parameters()
    return sum(p.numel() for n, p in named if not tables or ".table." in n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavors", default="debug,mid")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    init_logging(init_distributed("cpu")[0])
    rows = []
    for flavor in args.flavors.split(","):
        base, eng = make_variant(flavor, False, args), make_variant(flavor, True, args)
        times: dict[str, list[float]] = {"base": [], "engram": []}
        for i in range(args.steps + WARMUP):
            tb, te = base.timed_step().wall_s, eng.timed_step().wall_s
            if i >= WARMUP:
                times["base"].append(tb)
                times["engram"].append(te)
        mb, me = statistics.median(times["base"]), statistics.median(times["engram"])
        n_base, n_table = _params(base), _params(eng, tables=True)
        rows.append((flavor, n_base, _params(eng) - n_base, n_table, mb * 1e3, me * 1e3, me / mb))
    print(
        f"batch {args.batch} x {args.seq}, {args.threads} threads, median of {args.steps} steps "
        f"after {WARMUP}\n"
    )
    print(
        "| shape | backbone params | Engram params (tables) | step w/o Engram (ms) | "
        "step with Engram (ms) | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for flavor, nb, ne, nt, mb, me, r in rows:
        print(
            f"| {flavor} | {nb / 1e6:.1f} M | {ne / 1e6:.1f} M ({nt / 1e6:.1f} M) | {mb:.0f} | "
            f"{me:.0f} | {r:.2f} |"
        )


if __name__ == "__main__":
    main()
