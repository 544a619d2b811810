"""Held-out loss of the debug model per Engram table optimizer on the synthetic facts data.

    python benchmarks/table_optimizer_quality.py --steps 60 --seeds 0,1,2 \
        --optimizers adam,lazy_adam,rowwise_adagrad [--rowwise-lr-mults 1,4]

The debug recipe (train_configs/debug_model.toml) with only optimizer.table_optimizer (and, for
rowwise_adagrad, optionally the table lr) changed; same backbone, data order and seeds as
benchmarks/engram_vs_baseline.py. A lower held-out loss = better recall of memorised facts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/ is not an installed package
from engram.config import load_config  # noqa: E402
from recipes.train import train  # noqa: E402


def run(name: str, lr_mult: float, seed: int, steps: int, folder: str) -> tuple[float, float]:
    base = load_config(["--job.config_file=train_configs/debug_model.toml"])
    cfg = load_config(
        [
            "--job.config_file=train_configs/debug_model.toml",
            f"--job.dump_folder={folder}",
            f"--job.run_name={name}_{lr_mult}_seed{seed}",
            f"--job.seed={seed}",
            "--job.device=cpu",
            f"--optimizer.table_optimizer={name}",
            f"--optimizer.table_lr_mult={base.optimizer.table_lr_mult * lr_mult}",
            f"--training.steps={steps}",
            "--data.eval_batches=8",
            "--metrics.log_freq=1000000",
        ]
    )
    result = train(cfg)
    return result.losses[-1], result.eval_losses[steps]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--optimizers", default="adam,lazy_adam,rowwise_adagrad")
    ap.add_argument("--rowwise-lr-mults", default="1", help="x the table lr, rowwise_adagrad only")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = []
    for name in args.optimizers.split(","):
        mults = args.rowwise_lr_mults.split(",") if name == "rowwise_adagrad" else ["1"]
        variants += [(name, float(m)) for m in mults]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, mult in variants:
            res = [run(name, mult, seed, args.steps, folder) for seed in seeds]
            rows.append((name, mult, res))
            print(f"{name} x{mult}: {res}", flush=True)
    print(f"\ndebug model, {args.steps} steps, synthetic facts, held-out loss (train loss)\n")
    print(
        "| table optimizer | table lr | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean held-out |"
    )
    print("| --- | --- | " + " | ".join("---" for _ in seeds) + " | --- |")
    for name, mult, res in rows:
        cells = " | ".join(f"{ev:.4f} ({tr:.4f})" for tr, ev in res)
        mean = sum(ev for _, ev in res) / len(res)
        print(f"| {name} | x{mult:g} | {cells} | {mean:.4f} |")


if __name__ == "__main__":
    main()
