"""On the synthetic facts data, the debug recipe with Engram reaches a lower held-out loss than
the same recipe without Engram at the same step (fixed seeds). docs/benchmarks.md has the table
for three seeds (benchmarks/engram_vs_baseline.py)."""

from __future__ import annotations

import pytest
from launcher import run_distributed

from engram.config import load_config


def _eval_loss(rank: int, world: int, folder: str, enabled: bool) -> float:
    from recipes.train import train

    cfg = load_config(
        [
            "--job.config_file=train_configs/debug_model.toml",
            f"--job.dump_folder={folder}",
            f"--job.run_name=engram_{enabled}",
            "--job.device=cpu",
            f"--engram.enabled={enabled}",
            "--data.eval_batches=8",
            "--metrics.enable_tensorboard=false",
        ]
    )
    return train(cfg).eval_losses[cfg.training.steps]


@pytest.mark.slow
def test_engram_lowers_held_out_loss(tmp_path):
    without = run_distributed(_eval_loss, 1, str(tmp_path), False)[0]
    with_engram = run_distributed(_eval_loss, 1, str(tmp_path), True)[0]
    # Measured 2.80 vs 3.22 (seed 0); require a clear margin, not a tie.
    assert with_engram < without - 0.1, (with_engram, without)
