"""A DeepSpeed engine save is bounded in time and ships no helper script that unpickles.

runner/deepspeed_save.py: a rank stuck inside DeepSpeed's save collectives (another rank
failed in them) exits after the timeout naming the cause; a collective's own timeout becomes a
CheckpointError naming it; zero_to_fp32.py / zero_to_torch.py are removed from the engine
folder. The stuck collective is a save that never returns (one process, no DeepSpeed);
tests/test_parallelisms_deepspeed_files.py checks real step folders hold no recovery script.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engram.checkpoint import CheckpointError
from runner.deepspeed_save import RECOVERY_SCRIPTS, WATCHDOG_EXIT_CODE, save_bounded

ROOT = Path(__file__).resolve().parents[1]
STUCK = """
import threading
from pathlib import Path
from runner.deepspeed_save import save_bounded
save_bounded(threading.Event().wait, Path("step-9.tmp/engine"), 1.0)  # never returns
print("returned")
"""


def test_a_save_stuck_in_a_collective_exits_naming_the_cause():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", STUCK], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == WATCHDOG_EXIT_CODE, res.stdout + res.stderr
    assert "returned" not in res.stdout
    assert "save_checkpoint into step-9.tmp/engine did not finish within 1 s" in res.stderr
    assert "another rank most likely failed inside DeepSpeed's save collectives" in res.stderr


def test_a_collective_timeout_names_the_cause_and_other_errors_pass(tmp_path):
    def timed_out():
        raise RuntimeError("[gloo] Timed out waiting 1000ms for recv operation to complete")

    with pytest.raises(CheckpointError, match=r"did not finish within 60 s .*Timed out waiting"):
        save_bounded(timed_out, tmp_path, 60.0)

    def disk_full():
        raise RuntimeError("unexpected pos 704 vs 598")

    with pytest.raises(RuntimeError, match="unexpected pos"):  # the manager names these
        save_bounded(disk_full, tmp_path, 60.0)


def test_recovery_scripts_are_removed(tmp_path):
    def save():
        (tmp_path / "model").mkdir()
        for script in RECOVERY_SCRIPTS:
            (tmp_path / script).write_text("torch.load(f, weights_only=False)\n")

    save_bounded(save, tmp_path, 60.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
