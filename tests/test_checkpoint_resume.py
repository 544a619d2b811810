"""Resume from a DCP checkpoint at world 2 (FSDP2 + row-sharded tables + per-rank loader state)
reproduces the uninterrupted run's losses exactly."""

from __future__ import annotations

import json

import pytest
from launcher import run_distributed
from small_job import small_job

from engram.config import config_from_dict


def _raw(folder: str, load_step: int, num_workers: int) -> dict:
    extra = {
        "job": {"seed": 5},
        "training": {"local_batch_size": 2},
        "data": {"num_workers": num_workers},
        "optimizer": {"lr": 3e-4},
        "metrics": {"log_freq": 1},
        "checkpoint": {"enable": True, "interval": 3, "keep_latest_k": 0, "load_step": load_step},
    }
    return small_job(folder, "resume", 2, 6, extra)


def _train(rank: int, world: int, raw: dict) -> dict:
    from recipes.train import train

    result = train(config_from_dict(raw))
    return {"losses": result.losses, "start_step": result.start_step}


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_reproduces_uninterrupted_run(tmp_path, num_workers):
    full = run_distributed(_train, 2, _raw(str(tmp_path), -1, num_workers))
    assert full[0]["start_step"] == 0 and len(full[0]["losses"]) == 6
    ckpt = tmp_path / "resume" / "checkpoint"
    assert (ckpt / "step-3").is_dir() and (ckpt / "step-6").is_dir()
    # Fresh processes resume from step 3 and must replay steps 4..6 bit for bit.
    resumed = run_distributed(_train, 2, _raw(str(tmp_path), 3, num_workers))
    for rank in range(2):
        assert resumed[rank]["start_step"] == 3
        assert resumed[rank]["losses"] == full[rank]["losses"][3:]
    # metrics.jsonl keeps appending: steps 1..6 from the first run, then 4..6 again.
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "resume" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-3:] == [4, 5, 6]
