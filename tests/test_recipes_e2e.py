"""End to end through the README command: run_train.sh on the debug config, on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from launcher import free_port
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]


def _run_train(tmp_path: Path, *args: str, **env: str) -> tuple[str, list[dict]]:
    """./run_train.sh on the debug config into `tmp_path`: (its stdout, metrics.jsonl's records)."""
    env = {
        **os.environ,
        "CONFIG_FILE": "train_configs/debug_model.toml",
        "MASTER_PORT": str(free_port()),
        # As torchrun gives each of several ranks: one thread. An NGPU=1 and an NGPU=2 run then
        # sum in the same order, and on this shared 2-core box a 2-thread rank spin-waits (the
        # 60-step run took 3 to 27 s per step at a load average of ~10, and timed out).
        "OMP_NUM_THREADS": "1",
        **env,
    }
    proc = subprocess.run(
        ["./run_train.sh", f"--job.dump_folder={tmp_path}", "--metrics.log_freq=1", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (tmp_path / "debug" / "metrics.jsonl").read_text().splitlines()
    return proc.stdout, [json.loads(line) for line in lines]


@pytest.mark.slow
def test_run_train_debug_model_learns(tmp_path):
    stdout, records = _run_train(tmp_path)
    run = tmp_path / "debug"
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 60
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert any("eval_loss" in r for r in records)
    assert {"lr", "grad_norm", "tokens_per_s"} <= records[0].keys()
    # Throughput accounting (engram/train/throughput.py), the peak measured on this CPU: an
    # indicative MFU (it moves with the machine's load), never asserted against 100.
    for r in (r for r in records if "loss" in r):
        assert r["tflops"] > 0 and r["mfu_indicative"] > 0 and "mfu" not in r, r
        assert r["max_active_gib"] > 0 and 0 < r["max_reserved_pct"] < 100, r
        assert 0 <= r["data_time_s"] < r["step_time_s"] and 0 <= r["data_pct"] < 100, r
    assert "MFU against peak" in stdout and "(measured: cpu" in stdout
    assert "model FLOPs per token" in stdout
    events = list((run / "tb").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert len(acc.Scalars("loss")) == 60
    assert len(acc.Scalars("mfu_indicative")) == 60 and len(acc.Scalars("data_pct")) == 60
    assert len(acc.Scalars("target_tokens")) == 60
    # Packed text: every position of the global batch (8 x 128) is a target.
    steps = [r for r in records if "loss" in r]
    assert all(r["target_tokens"] == 8 * 128 for r in steps), steps[0]
    assert all(r["target_tokens_per_s"] == pytest.approx(r["tokens_per_s"]) for r in steps)

    # training.global_batch_size: the same file at NGPU=2 trains the same global batch (2 ranks
    # x 2 sequences x 2 accumulation steps, against 1 x 2 x 4): its first 4 steps (in the
    # warmup, so the same learning rates) give the same losses to 1e-6 and gradient norms to
    # 1e-5 (measured: losses 7.5e-8, norms 9.3e-7 relative).
    _, two = _run_train(tmp_path / "ngpu2", "--training.steps=4", NGPU="2")
    two = [r for r in two if "loss" in r]
    assert [r["lr"] for r in two] == [r["lr"] for r in steps[:4]]
    for key, rtol in (("loss", 1e-6), ("grad_norm", 1e-5)):
        got, want = [r[key] for r in two], [r[key] for r in steps[:4]]
        assert all(abs(g - w) <= rtol * abs(w) for g, w in zip(got, want, strict=True)), key


@pytest.mark.slow
def test_a_copied_recipe_runs_its_own_loop(tmp_path):
    """As a user works: copy recipes/train.py, add a metric in its loop, run the copy through
    TRAIN_SCRIPT=... ./run_train.sh; the metric is in metrics.jsonl next to the step's loss."""
    recipe = (ROOT / "recipes" / "train.py").read_text()
    anchor = "            run.end_step(step, out)\n"
    assert recipe.count(anchor) == 1, "the recipe's loop no longer ends its step this way"
    added = '            run.metrics.log(step, {"twice_the_loss": 2 * out.loss})\n'
    script = tmp_path / "my_train.py"
    script.write_text(recipe.replace(anchor, anchor + added))
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    small = ["--training.steps=3", "--training.local_batch_size=2", "--training.seq_len=32",
             "--data.eval_batches=1", "--metrics.enable_tensorboard=false"]  # fmt: skip
    _, records = _run_train(tmp_path, *small, TRAIN_SCRIPT=str(script), PYTHONPATH=pythonpath)
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    mine = {r["step"]: r["twice_the_loss"] for r in records if "twice_the_loss" in r}
    assert sorted(mine) == sorted(losses) == [1, 2, 3], records
    assert all(mine[s] == pytest.approx(2 * losses[s], rel=1e-6) for s in mine), (mine, losses)
