"""Crash and restart through run_train.sh: kill -9 a rank mid-step and mid-save (2 times each, on
both ranks) in one 2-process job with MAX_RESTARTS=4. Every try must resume from the newest
complete checkpoint, and every logged loss must equal the uninterrupted run's bit for bit.
A hang is bounded by the subprocess timeout and fails the test with the output so far."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from launcher import free_port
from small_job import small_job

from engram.checkpoint import verify_checkpoint
from engram.config import config_from_dict, to_toml

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
# attempt:kind:rank:step (see tests/fault_train.py)
FAULTS = "0:step:1:3,1:save:0:4,2:step:0:5,3:save:1:6"
EXPECTED = [  # (complete checkpoints seen by each try, the step it resumed from)
    ([], 0),
    ([2], 2),  # killed in step 3
    ([2], 2),  # killed while saving step 4: step-4.tmp is not a checkpoint
    ([2, 4], 4),  # killed in step 5
    ([2, 4], 4),  # killed while saving step 6
]


def _config(tmp_path: Path, name: str) -> Path:
    extra = {
        "job": {"seed": 2},
        "training": {"seq_len": 16, "local_batch_size": 2},
        "data": {"synthetic_num_entities": 32},
        "optimizer": {"lr": 3e-4},
        "checkpoint": {"enable": True, "interval": 2, "keep_latest_k": 0},
        "metrics": {"log_freq": 1},
    }
    raw = small_job(str(tmp_path), name, 2, STEPS, extra)
    path = tmp_path / f"{name}.toml"
    path.write_text(to_toml(config_from_dict(raw)))
    return path


def _launch(tmp_path: Path, name: str, faults: str, restarts: int) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "CONFIG_FILE": str(_config(tmp_path, name)),
        "TRAIN_SCRIPT": str(ROOT / "tests" / "fault_train.py"),
        "NGPU": "2",
        "MASTER_PORT": str(free_port()),
        "MAX_RESTARTS": str(restarts),
        "FAULTS": faults,
        "FAULT_LOG": str(tmp_path / f"{name}.attempts.jsonl"),
        "LOG_RANK": "0,1",
    }
    proc = subprocess.Popen(
        [str(ROOT / "run_train.sh")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name}: the job hung (timeout 480 s); output tail:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _losses(tmp_path: Path, name: str) -> list[tuple[int, float]]:
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.slow
def test_kill_mid_step_and_mid_save_resumes_and_replays_bit_for_bit(tmp_path):
    ref = _launch(tmp_path, "ref", "", 0)
    assert ref.returncode == 0, ref.stdout[-4000:]
    reference = dict(_losses(tmp_path, "ref"))
    assert sorted(reference) == list(range(1, STEPS + 1))

    run = _launch(tmp_path, "faulty", FAULTS, 4)
    assert run.returncode == 0, run.stdout[-6000:]
    attempts = [
        json.loads(line) for line in (tmp_path / "faulty.attempts.jsonl").read_text().splitlines()
    ]
    assert [(a["complete"], a["start"]) for a in attempts] == EXPECTED, attempts
    assert [a["attempt"] for a in attempts] == list(range(len(EXPECTED)))
    logged = _losses(tmp_path, "faulty")
    assert {step for step, _ in logged} == set(range(1, STEPS + 1))
    for step, loss in logged:  # every try, including the replayed steps
        assert loss == reference[step], (step, loss, reference[step])
    folder = tmp_path / "faulty" / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == [
        "latest",
        "step-2",
        "step-4",
        "step-6",
    ]
    assert verify_checkpoint(folder / "step-6", collective=False) == []
