"""kill -9 with NVMe (and host) Engram tables through the real entry point (run_train.sh ->
torchrun -> recipes/train.py via tests/fault_train.py), checkpoints every 2 of 4 steps:

- one 1-rank NVMe job that torchrun restarts 3 times (as tests/test_recipes_faults_restart.py
  does for device tables): ENOSPC on a page write-back in step 3 stops try 0 naming the file and
  the fix; try 1 is killed mid-write-back (SIGKILL at a page an NVMe store wrote back, with the
  rest of that eviction batch in flight; ENGRAM_FAULTS, engram/runtime/faults.py), try 2
  mid-step (after backward, before the optimizer update of step 3; FAULTS); every try resumes
  from the newest complete checkpoint in fresh page files, and every logged loss and grad norm
  equals the uninterrupted run's bit for bit; host tables killed mid-step likewise;
- 2 ranks, rank 1 killed mid-write-back without restarts: torchrun tears the job down (rank 0
  does not hang), and a second launch resumes from the last checkpoint bitwise;
- the page files the killed processes left are removed by the next run's stores (logged with
  their GiB and the run that left them: pid, rank, last write), so the NVMe directories end
  with none;
- without a next run, scripts/page_files.py lists and removes exactly a killed run's files, never
  a live store's in the same directories.

The write-back faults are armed when step 3 starts (after step 2's checkpoint was committed or
resumed from) and fire at the second page written back from then on: step 3's pin or step 4's
page-in evicts pages steps 1-2 updated (the cache is ~10x smaller than the shard), so a
write-back follows for certain, whenever the asynchronous page-in runs it (tests/fault_train.py).

The uninterrupted reference of the host-table run is the NVMe one: host and NVMe tables train
bitwise like device tables (tests/test_parallelisms_host_tables.py, _nvme_tables.py)."""

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
STEPS = 4
FAULT = 3  # the step every fault hits: the first after step 2's checkpoint


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


def _launch(tmp: Path, name: str, world: int, location: str, restarts: int, faults: str = ""):
    env = {
        **os.environ,
        "CONFIG_FILE": str(_config(tmp, name, world, location)),
        "TRAIN_SCRIPT": str(ROOT / "tests" / "fault_train.py"),
        "NGPU": str(world),
        "MASTER_PORT": str(free_port()),
        "MAX_RESTARTS": str(restarts),
        "FAULTS": faults,  # tests/fault_train.py
        "ENGRAM_FAULTS": "",  # armed by FAULTS' write / nospace entries only
        "FAULT_LOG": str(tmp / f"{name}.attempts.jsonl"),
        "LOG_RANK": ",".join(map(str, range(world))),
    }
    start = time.monotonic()
    proc = subprocess.Popen([str(ROOT / "run_train.sh")], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    timeout = 240 * (restarts + 1) + 240  # a hang, not a slow try of a loaded machine
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name}: the job hung (timeout {timeout} s); output tail:\n{out[-4000:]}")
    with open(tmp / f"{name}.out", "a") as f:  # every try's whole output, to read a failure
        f.write(out)
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted NVMe runs: world -> {step: (loss, grad norm)}."""
    runs = {}

    def get(world: int) -> dict:
        if world not in runs:
            tmp = tmp_path_factory.mktemp(f"ref{world}")
            rc, out, _ = _launch(tmp, "ref", world, "nvme", 0)
            assert rc == 0, out[-4000:]
            logged = {s: (loss, norm) for s, loss, norm in _logged(tmp, "ref")}
            assert sorted(logged) == list(range(1, STEPS + 1))
            runs[world] = logged
        return runs[world]

    return get


def _swept(out: str, rank: int) -> None:
    """The next run's stores removed the page files rank `rank` of a killed run left, naming
    how many GiB and which run left them."""
    for d in ("nvme_a", "nvme_b"):
        swept = (rf"WARNING NVMe Engram table: removed 1 page file\(s\), \d+\.\d{{3}} GiB, from "
                 rf"\S+/{d}, left by a run that ended .*\(pid \d+, rank {rank}, last written ")  # fmt: skip
        assert re.search(swept, out), out[-6000:]


@pytest.mark.slow
def test_nvme_enospc_then_kills_mid_write_back_and_mid_step_resume_bitwise(tmp_path, reference):
    """Try 0: ENOSPC on a page write-back in step 3 (on an I/O thread: step 3's pin or step 4's
    page-in); the run stops with the error naming the file and the fix (raised on the main
    thread by the prefetch that needs the batch's pages: step 3's or step 4's) and saves nothing
    after it. Try 1: killed mid-write-back in step 3. Try 2: killed mid-step 3. Each resumes
    from step 2's checkpoint; every logged step equals the uninterrupted run's bitwise. (A lost
    write-back of a page step 3 does not use leaves step 3 exact: its rows came pinned and are
    in the cache.)"""
    faults = f"0:nospace:0:{FAULT},1:write:0:{FAULT},2:step:0:{FAULT}"
    rc, out, _ = _launch(tmp_path, "run", 1, "nvme", 3, faults=faults)
    assert rc == 0, out[-6000:]
    assert _attempts(tmp_path, "run") == [([], 0)] + [([2], 2)] * 3, out[-6000:]
    named = (
        r"OSError: \[Errno 28\] NVMe Engram table: No space left on device.* writing a page back "
    )
    assert re.search(
        named + r"to \S+\.pages: free space on that drive, point engram.nvme_dirs", out
    ), out[-6000:]
    _check_replay(tmp_path, "run", reference(1))
    # Step 4 logged once: no try before the last got past step 3's update and step 4's prefetch
    # (the ENOSPC try stopped by then, so it saved nothing after step 2).
    assert [step for step, *_ in _logged(tmp_path, "run")].count(STEPS) == 1
    assert out.count("left by a run that ended") == 4, out[-6000:]  # tries 1, 2: 2 files each
    _swept(out, 0)
    _no_page_files_left(tmp_path)


@pytest.mark.slow
def test_host_tables_kill_mid_step_resumes_bitwise(tmp_path, reference):
    rc, out, _ = _launch(tmp_path, "run", 1, "host", 1, faults=f"0:step:0:{FAULT}")
    assert rc == 0, out[-6000:]
    assert _attempts(tmp_path, "run") == [([], 0), ([2], 2)]
    _check_replay(tmp_path, "run", reference(1))


@pytest.mark.slow
def test_two_ranks_one_killed_mid_write_back_then_resumed(tmp_path, reference):
    """No restarts: rank 1 dies, torchrun stops rank 0 (blocked in a collective or not) and the
    job fails; launched again, it resumes from step 2 bitwise and sweeps both ranks' files."""
    rc, out, took = _launch(tmp_path, "run", 2, "nvme", 0, faults=f"0:write:1:{FAULT}")
    assert rc != 0 and "SIGKILL" in out, out[-6000:]
    print(f"2 ranks, rank 1 killed mid-write-back: the job ended (rc {rc}) after {took:.1f} s")
    assert len(os.listdir(tmp_path / "nvme_a")) == 3  # the lock + both ranks' files
    rc, out, _ = _launch(tmp_path, "run", 2, "nvme", 0)
    assert rc == 0, out[-6000:]
    assert _attempts(tmp_path, "run") == [([], 0), ([2], 2)]
    _check_replay(tmp_path, "run", reference(2))
    assert out.count("left by a run that ended") == 4, out[-6000:]  # 2 ranks x 2 dirs
    _no_page_files_left(tmp_path)


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
        rc, out, _ = _launch(tmp_path, "run", 1, "nvme", 0, faults="0:step:0:1")
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
