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


@pytest.mark.slow
def test_run_train_debug_model_learns(tmp_path):
    env = {
        **os.environ,
        "CONFIG_FILE": "train_configs/debug_model.toml",
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.run(
        ["./run_train.sh", f"--job.dump_folder={tmp_path}", "--metrics.log_freq=1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "debug"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
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
    assert "MFU against peak" in proc.stdout and "(measured: cpu" in proc.stdout
    assert "model FLOPs per token" in proc.stdout
    events = list((run / "tb").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert len(acc.Scalars("loss")) == 60
    assert len(acc.Scalars("mfu_indicative")) == 60 and len(acc.Scalars("data_pct")) == 60
