"""kill -9 with NVMe (and host) Engram tables through the real entry point (run_train.sh ->
torchrun -> recipes/train.py via tests/fault_train.py), checkpoints every 2 of 6 steps:

- mid-step (after backward, before the optimizer update of step 5; FAULTS, tests/fault_train.py)
  and mid-write-back (SIGKILL after the n-th page an NVMe store wrote back, with the rest of that
  eviction batch in flight; ENGRAM_FAULTS, engram/runtime/faults.py), torchrun restarting the job
  once: the restart resumes from the newest complete checkpoint in fresh page files, and every
  logged loss and grad norm equals the uninterrupted run's bit for bit;
- 2 ranks, rank 1 killed mid-write-back without restarts: torchrun tears the job down (rank 0
  does not hang), and a second launch resumes from the last checkpoint bitwise;
- the page files the killed processes left are removed by the next run's stores (logged with
  their GiB and the run that left them: pid, rank, last write), so the NVMe directories end
  with none;
- without a next run, scripts/page_files.py lists and removes exactly a killed run's files, never
  a live store's in the same directories.

The mid-write-back kill points are read off the uninterrupted run of the same config (its page
write-backs counted per rank, ENGRAM_FAULTS "count"): halfway between the writes done when step
4's checkpoint was saved and those done when step 5 reached its update (its prefetch's and the
next step's page-in's eviction batches)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher import free_port
from small_job import small_job

from engram.config import config_from_dict, to_toml
from engram.rowstore.nvme_store import NvmeRowStore

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
COUNT = "nvme.page_write:0:count"  # count the page writes, for the kill points


def _config(tmp: Path, name: str, world: int, location: str) -> Path:
    engram = {"table_location": location, "vocab_size_per_ngram": [200003, 199999]}
    if location == "nvme":  # a rank's shard is ~10x its host cache: pages go back and forth
        engram |= {"nvme_dirs": [str(tmp / "nvme_a"), str(tmp / "nvme_b")],
                   "nvme_create_dirs": True, "nvme_host_cache_gib": 5 / world / 1024}  # fmt: skip
    raw = small_job(str(tmp), name, world, STEPS, {
        "engram": engram,
        "optimizer": {"table_optimizer": "lazy_adam"},
        "checkpoint": {"enable": True, "interval": 2, "keep_latest_k": 0},
        "metrics": {"log_freq": 1},
    })  # fmt: skip
    path = tmp / f"{name}.toml"
    path.write_text(to_toml(config_from_dict(raw)))
    return path


def _launch(tmp: Path, name: str, world: int, location: str, restarts: int, **faults: str):
    env = {
        **os.environ,
        "CONFIG_FILE": str(_config(tmp, name, world, location)),
        "TRAIN_SCRIPT": str(ROOT / "tests" / "fault_train.py"),
        "NGPU": str(world),
        "MASTER_PORT": str(free_port()),
        "MAX_RESTARTS": str(restarts),
        "FAULTS": faults.get("FAULTS", ""),
        "ENGRAM_FAULTS": faults.get("ENGRAM_FAULTS", ""),
        "FAULT_LOG": str(tmp / f"{name}.attempts.jsonl"),
        "COUNT_LOG": str(tmp / f"{name}.counts.jsonl")
        if faults.get("ENGRAM_FAULTS") == COUNT
        else "",
        "LOG_RANK": ",".join(map(str, range(world))),
    }
    start = time.monotonic()
    proc = subprocess.Popen([str(ROOT / "run_train.sh")], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name}: the job hung (timeout 480 s); output tail:\n{out[-4000:]}")
    return proc.returncode, out, time.monotonic() - start


def _logged(tmp: Path, name: str) -> list[tuple[int, float, float]]:
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if "loss" in r]


def _attempts(tmp: Path, name: str) -> list[tuple[list[int], int]]:
    lines = (tmp / f"{name}.attempts.jsonl").read_text().splitlines()
    return [(a["complete"], a["start"]) for a in map(json.loads, lines)]


def _check_replay(tmp: Path, name: str, reference: dict) -> None:
    logged = _logged(tmp, name)
    assert {step for step, *_ in logged} == set(range(1, STEPS + 1))
    for step, loss, norm in logged:  # every try, the replayed steps too
        assert (loss, norm) == reference[step], (step, loss, norm, reference[step])


def _no_page_files_left(tmp: Path) -> None:
    for d in ("nvme_a", "nvme_b"):
        assert sorted(os.listdir(tmp / d)) == [".engram-pages.lock"], os.listdir(tmp / d)


def _kill_points(tmp: Path, name: str, world: int) -> dict[int, int]:
    """rank -> the page write-back to die at: halfway between the writes done when step 4's
    checkpoint was saved and those done when step 5 reached its update."""
    counts = [json.loads(line) for line in (tmp / f"{name}.counts.jsonl").read_text().splitlines()]
    points = {}
    for rank in range(world):
        at = {(c["at"], c["step"]): c["page_writes"] for c in counts if c["rank"] == rank}
        lo, hi = at["saved", 4], at["clip", 5]
        assert hi - lo >= 2, (rank, lo, hi)  # step 5 writes pages back before its update
        points[rank] = (lo + hi) // 2
    return points


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs: {(location, world): ({step: (loss, grad norm)}, {rank: kill point})}."""
    runs = {}

    def get(location: str, world: int) -> tuple[dict, dict]:
        if (location, world) not in runs:
            tmp = tmp_path_factory.mktemp(f"ref_{location}{world}")
            count = {"ENGRAM_FAULTS": COUNT} if location == "nvme" else {}
            rc, out, _ = _launch(tmp, "ref", world, location, 0, **count)
            assert rc == 0, out[-4000:]
            logged = {s: (loss, norm) for s, loss, norm in _logged(tmp, "ref")}
            assert sorted(logged) == list(range(1, STEPS + 1))
            kills = _kill_points(tmp, "ref", world) if location == "nvme" else {}
            runs[location, world] = logged, kills
        return runs[location, world]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("location", ["nvme", "host"])
def test_kill_mid_step_resumes_bitwise(tmp_path, reference, location):
    rc, out, _ = _launch(tmp_path, "run", 1, location, 1, FAULTS="0:step:0:5")
    assert rc == 0, out[-6000:]
    assert _attempts(tmp_path, "run") == [([], 0), ([2, 4], 4)]
    _check_replay(tmp_path, "run", reference(location, 1)[0])
    if location == "nvme":
        assert out.count("left by a run that ended") == 2, out[-6000:]  # attempt 0's 2 files
        for d in ("nvme_a", "nvme_b"):  # how many GiB, and which run left them
            swept = (rf"WARNING NVMe Engram table: removed 1 page file\(s\), \d+\.\d{{3}} GiB, from "
                     rf"\S+/{d}, left by a run that ended .*\(pid \d+, rank 0, last written ")  # fmt: skip
            assert re.search(swept, out), out[-6000:]
        _no_page_files_left(tmp_path)


@pytest.mark.slow
def test_kill_mid_write_back_resumes_bitwise(tmp_path, reference):
    logged, kills = reference("nvme", 1)
    rc, out, _ = _launch(
        tmp_path, "run", 1, "nvme", 1, ENGRAM_FAULTS=f"nvme.page_write:{kills[0]}:kill:0"
    )
    assert rc == 0, out[-6000:]
    assert _attempts(tmp_path, "run") == [([], 0), ([2, 4], 4)]
    _check_replay(tmp_path, "run", logged)
    assert out.count("left by a run that ended") == 2, out[-6000:]
    _no_page_files_left(tmp_path)


@pytest.mark.slow
def test_two_ranks_one_killed_mid_write_back_then_resumed(tmp_path, reference):
    """No restarts: rank 1 dies, torchrun stops rank 0 (blocked in a collective or not) and the
    job fails; launched again, it resumes from step 4 bitwise and sweeps both ranks' files."""
    logged, kills = reference("nvme", 2)
    kill = f"nvme.page_write:{kills[1]}:kill:1"
    rc, out, took = _launch(tmp_path, "run", 2, "nvme", 0, ENGRAM_FAULTS=kill)
    assert rc != 0 and "SIGKILL" in out, out[-6000:]
    print(f"2 ranks, rank 1 killed mid-write-back: the job ended (rc {rc}) after {took:.1f} s")
    assert len(os.listdir(tmp_path / "nvme_a")) == 3  # the lock + both ranks' files
    rc, out, _ = _launch(tmp_path, "run", 2, "nvme", 0)
    assert rc == 0, out[-6000:]
    assert _attempts(tmp_path, "run") == [([], 0), ([2, 4], 4)]
    _check_replay(tmp_path, "run", logged)
    assert out.count("left by a run that ended") == 4, out[-6000:]  # 2 ranks x 2 dirs
    _no_page_files_left(tmp_path)


@pytest.mark.slow
def test_no_space_mid_write_back_stops_the_run_naming_the_fix(tmp_path, reference):
    """ENOSPC on a page write-back in step 5 (on an I/O thread: step 5's prefetch or step 6's
    page-in): the run stops with the error naming the file and the fix (raised on the main
    thread by the next prefetch that needs the batch's pages: step 5's or step 6's), and saves
    nothing after it: the last checkpoint is step 4's. (A lost write-back of a page step 5
    does not use leaves step 5 exact: its rows came pinned and are in the cache.)"""
    point = f"nvme.page_write:{reference('nvme', 1)[1][0]}:enospc:0"
    rc, out, _ = _launch(tmp_path, "run", 1, "nvme", 0, ENGRAM_FAULTS=point)
    assert rc != 0, out[-6000:]
    named = (
        r"OSError: \[Errno 28\] NVMe Engram table: No space left on device.* writing a page back "
    )
    assert re.search(
        named + r"to \S+\.pages: free space on that drive, point engram.nvme_dirs", out
    )
    assert max(step for step, *_ in _logged(tmp_path, "run")) in (4, 5)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == [
        "latest", "step-2", "step-4"
    ]  # fmt: skip


def _page_files(action: str, dirs: list[Path]) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "page_files.py"), action, *map(str, dirs)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return proc.stdout.strip().splitlines()


@pytest.mark.slow
def test_killed_runs_page_files_are_listed_and_removed_by_hand(tmp_path):
    """kill -9 of a 1-rank NVMe run, no restart: its page files stay (a shard per rank).
    scripts/page_files.py lists exactly them and removes exactly them; a live store's files
    in the same directories (this process's) are neither listed nor removed."""
    dirs = [tmp_path / "nvme_a", tmp_path / "nvme_b"]
    for d in dirs:
        d.mkdir()
    live = NvmeRowStore(5000, {"weight": 8}, list(map(str, dirs)), 4 * 4096, name="live")
    try:
        rc, out, _ = _launch(tmp_path, "run", 1, "nvme", 0, FAULTS="0:step:0:2")
        assert rc != 0 and "SIGKILL" in out, out[-6000:]
        left = sorted(str(p) for d in dirs for p in d.glob("*.pages") if str(p) not in live.paths)
        assert len(left) == 2, left  # the killed run's table, striped over both drives
        listed = _page_files("list", dirs)
        assert sorted(line.split("\t")[0] for line in listed[:-1]) == left, listed
        assert all(re.search(r"\tpid \d+, rank 0, last written ", line) for line in listed[:-1])
        assert listed[-1].startswith("2 dead page files, "), listed
        removed = _page_files("remove", dirs)
        assert sorted(line.split("\t")[0] for line in removed[:-1]) == left, removed
        assert not any(os.path.exists(p) for p in left)
        assert all(os.path.exists(p) for p in live.paths)
        assert _page_files("list", dirs) == [
            "0 dead page files, 0.000 GiB (live runs' files left alone)"
        ]
    finally:
        live.close()
        live.remove_files()
