"""Refused at start, by name, before step 1 (runner/start_checks.py, by the planner's rules): an
async save whose staging exceeds host memory, page files larger than the drive's free space, a
checkpoint folder too small for keep_latest_k saves. The limits are faked small (a host-memory
figure in the config, the free space a patched statvfs reading) so each refusal costs a model
build, not a run; one real save checks the checkpoint size the rule counts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from launcher import run_distributed
from small_job import small_job

from engram.config import config_from_dict

MIB = 2**20


def _start(rank: int, world: int, raw: dict, free: int | None, on_rank: int | None = None) -> dict:
    """Train `raw` with every file system reporting `free` bytes free (None: the real figure;
    `on_rank`: only there); the refusal's text, or what the run saved."""
    import recipes.train as recipe
    from engram.runtime import filesystems
    from runner import start_checks

    if free is not None and on_rank in (None, rank):
        filesystems.free_bytes = lambda path: free
    cfg = config_from_dict(raw)
    try:
        result = recipe.train(cfg)
    except ValueError as e:
        return {"refused": str(e)}
    counted, _ = start_checks._state_bytes(result.model_parts, cfg, local=False)
    return {"refused": None, "counted": counted, "losses": result.losses}


def _job(tmp: Path, name: str, **sections) -> dict:
    raw = small_job(str(tmp), name, 1, 2, {})
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def _refusal(raw: dict, free: int | None = None) -> str:
    (got,) = run_distributed(_start, 1, raw, free)
    assert got["refused"], "not refused"
    run = Path(raw["job"]["dump_folder"]) / raw["job"]["run_name"]
    assert not (run / "metrics.jsonl").exists()  # refused before step 1 (no metrics at all)
    return got["refused"]


@pytest.mark.slow
def test_refused_at_start_by_name(tmp_path):
    # An async save stages a copy of the state: more than the 1 KiB of host memory stated.
    async_save = _job(tmp_path, "async", checkpoint={"enable": True, "async_mode": "async"},
                      engram={"host_memory_gib": 2**-20})  # fmt: skip
    text = _refusal(async_save)
    assert "checkpoint host memory" in text and 'async_mode = "disabled"' in text, text
    assert "1.0 KiB of host memory (engram.host_memory_gib = " in text, text

    # Page files of a few MiB on a drive with 64 KiB free: refused before any is created.
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()  # a missing entry is refused before (engram/rowstore/nvme_checks.py)
    nvme = _job(tmp_path, "nvme", optimizer={"table_optimizer": "lazy_adam"},
                engram={"table_location": "nvme", "nvme_dirs": [str(nvme_dir)]})  # fmt: skip
    text = _refusal(nvme, free=64 * 1024)
    assert "NVMe capacity" in text and str(nvme_dir) in text and "64.0 KiB" in text, text
    assert not nvme_dir.exists() or not list(nvme_dir.glob("*.pages"))

    # keep_latest_k = 2 full saves (+ the one committing) in a folder with 1 MiB free.
    ckpt = _job(tmp_path, "ckpt", checkpoint={"enable": True, "interval": 1, "keep_latest_k": 2})
    text = _refusal(ckpt, free=MIB)
    assert "checkpoint disk" in text and "keep_latest_k = 2" in text, text
    assert not (tmp_path / "ckpt" / "checkpoint").exists()  # nothing saved

    # Two ranks, one whose drive is full: both stop at start, the other naming it.
    two = small_job(str(tmp_path), "two", 2, 2, {k: nvme[k] for k in ("optimizer", "engram")})
    got = run_distributed(_start, 2, two, 64 * 1024, 1)
    assert "NVMe capacity" in got[1]["refused"], got
    assert "by another rank" in got[0]["refused"], got


@pytest.mark.slow
def test_checkpoint_size_counted_like_a_real_save(tmp_path):
    """What the rule counts for one full save (weights + AdamW moments + table state) against
    the step folder DCP writes (+ small metadata files)."""
    raw = _job(tmp_path, "real", checkpoint={"enable": True, "interval": 2, "keep_latest_k": 1})
    (got,) = run_distributed(_start, 1, raw, None)
    assert got["refused"] is None and len(got["losses"]) == 2
    step = tmp_path / "real" / "checkpoint" / "step-2"
    on_disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(step) for f in fs)
    assert 0.97 * on_disk <= got["counted"] <= on_disk, (got["counted"], on_disk)
