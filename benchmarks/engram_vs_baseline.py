"""Held-out loss of the debug model with and without Engram on the synthetic facts data.

    python benchmarks/engram_vs_baseline.py --steps 200 --seeds 0,1

Same backbone, data order, steps and seeds; the only difference is `engram.enabled`. Held-out
documents are new sentences over the same fact base, so a lower held-out loss means better recall
of memorised facts.
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


def run(enabled: bool, seed: int, steps: int, folder: str, extra: list[str]) -> tuple[float, float]:
    cfg = load_config(
        [
            "--job.config_file=train_configs/debug_model.toml",
            f"--job.dump_folder={folder}",
            f"--job.run_name=engram_{enabled}_seed{seed}",
            f"--job.seed={seed}",
            "--job.device=cpu",
            f"--engram.enabled={enabled}",
            f"--training.steps={steps}",
            "--data.eval_batches=8",
            "--metrics.log_freq=1000000",
            *extra,
        ]
    )
    result = train(cfg)
    return result.losses[-1], result.eval_losses[steps]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--threads", type=int, default=2)
    args, extra = ap.parse_known_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in (int(s) for s in args.seeds.split(",")):
            base = run(False, seed, args.steps, folder, extra)
            eng = run(True, seed, args.steps, folder, extra)
            rows.append((seed, base, eng))
    print(f"\ndebug model, {args.steps} steps, synthetic facts\n")
    print(
        "| seed | train loss w/o Engram | train loss with Engram | held-out loss w/o Engram | held-out loss with Engram |"
    )
    print("| --- | --- | --- | --- | --- |")
    for seed, (bt, be), (et, ee) in rows:
        print(f"| {seed} | {bt:.4f} | {et:.4f} | {be:.4f} | {ee:.4f} |")


if __name__ == "__main__":
    main()
