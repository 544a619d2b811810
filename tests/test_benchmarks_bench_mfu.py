"""benchmarks/bench_mfu.py --config: a config's cut through the recipe's one step, shrunk on cpu.

One process (world 1), the 8B GPU config cut to 2 layers at tp 1: on cpu the widths shrink and
the output says so; the table holds the step time, TFLOP/s, MFU and rank 0's peak memory against
the planner's plan for the same cut (on cpu the ratio checks the plumbing only).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_mfu_runs_a_config_cut_shrunk_on_cpu() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    cmd = [
        sys.executable, "benchmarks/bench_mfu.py", "--config", "train_configs/8b_gpu.toml",
        "--layers", "2", "--parallelism.tp=1", "--training.seq_len=64",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "llama3/8B cut to 2 layers, Engram at layer 1" in out, out
    assert "cpu: widths / 16" in out and "SHRUNK on cpu" in out, out
    assert "compute dtype bfloat16" in out, out  # the config's, not the bench's
    row = out.strip().splitlines()[-1]
    step, _, tflops, mfu, measured, planned, ratio = [c.strip() for c in row.strip("|").split("|")]
    assert float(step) > 0 and float(tflops) > 0 and re.fullmatch(r"\d+\.\d%", mfu), row
    assert float(planned) > 0 and float(ratio) > 0, row


def test_bench_mfu_refuses_overrides_without_a_config() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    cmd = [sys.executable, "benchmarks/bench_mfu.py", "--parallelism.tp=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "needs --config" in proc.stderr, proc.stderr
