"""The NVMe row store under failures (engram/rowstore/page_files.py, page_io.py,
nvme_store.py, engram/runtime/faults.py): page files left by a kill -9 are swept by the next store without
touching a live store's; files are preallocated, so a drive that cannot hold them fails at
start, naming the fix; ENOSPC / EIO mid-write-back is an error that names the fix and surfaces
on the host worker's next result and wait (the main thread), failing every later job."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engram.rowstore import page_files
from engram.rowstore.host_worker import HostWorker
from engram.rowstore.nvme_store import NvmeRowStore
from engram.runtime import faults

ROOT = Path(__file__).resolve().parents[1]


def _store(dirs, name="t", rows=5000, cache_pages=4) -> NvmeRowStore:
    for d in dirs:  # a store never creates its directory (check_nvme_settings does, at start)
        os.makedirs(d, exist_ok=True)
    return NvmeRowStore(rows, {"weight": 8, "sum": 0}, [str(d) for d in dirs],
                        cache_bytes=cache_pages * 4096, name=name)  # fmt: skip


@pytest.fixture
def armed():
    """faults.configure for one test; disarmed after it."""
    yield faults.configure
    faults.configure("")


def test_fault_spec_parsing_and_filters(monkeypatch, armed):
    with pytest.raises(ValueError, match="point:n:action"):
        armed("nvme.page_write:2:explode")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    armed("a:1:eio:0,b:2:eio:1,c:1:eio::1,d:1:enospc")  # a: other rank; c: another attempt
    for name in ("a", "c", "b", "d", "unarmed"):
        if name != "d":
            faults.point(name)  # b's first hit passes
    with pytest.raises(OSError) as e:
        faults.point("b")
    assert e.value.errno == errno.EIO and "ENGRAM_FAULTS: hit 2 of b" in str(e.value)
    faults.point("b")  # only the n-th hit
    with pytest.raises(OSError) as e:
        faults.point("d")
    assert e.value.errno == errno.ENOSPC


def test_dead_runs_page_files_are_swept_live_ones_kept(tmp_path, caplog):
    """A process that SIGKILLs itself while its store is open leaves its files; the next store
    in that directory removes them (and logs it), but not a live store's nor other files."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    live = _store(dirs, "live")
    killed = subprocess.run(
        [sys.executable, "-c",
         "import os, signal, sys; sys.path.insert(0, sys.argv[1]);"
         "from engram.rowstore.nvme_store import NvmeRowStore as S;"
         "s = S(5000, {'weight': 8}, sys.argv[2:], 4 * 4096, name='dead');"
         "print(' '.join(s.paths), flush=True); os.kill(os.getpid(), signal.SIGKILL)",
         str(ROOT), *map(str, dirs)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    dead = killed.stdout.split()
    assert len(dead) == 2 and all(os.path.exists(p) for p in dead)
    assert os.stat(dead[0]).st_blocks * 512 >= 20 * 4096  # 40 pages over 2 files, allocated
    (tmp_path / "a" / "notes.pages").write_text("not a page file of ours")
    with caplog.at_level(logging.WARNING, logger=page_files.__name__):
        fresh = _store(dirs, "fresh")
    assert not any(os.path.exists(p) for p in dead)
    assert all(os.path.exists(p) for p in live.paths + fresh.paths)
    assert (tmp_path / "a" / "notes.pages").exists()
    assert sum("left by a run that ended" in r.message for r in caplog.records) == 2
    for s in (live, fresh):
        s.close()
        s.remove_files()
    assert sorted(os.listdir(dirs[0])) == [".engram-pages.lock", "notes.pages"]


def test_files_preallocated_and_no_space_at_start_names_the_fix(tmp_path, monkeypatch):
    store = _store([tmp_path])
    assert os.stat(store.paths[0]).st_blocks * 512 >= store.pages * store.page_bytes
    store.close()
    store.remove_files()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(page_files.os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"needs \d+ B but its drive has \d+ B free.*nvme_dirs") as e:
        _store([tmp_path / "x", tmp_path / "y"])
    assert e.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path / "x")) == [".engram-pages.lock"]  # nothing left behind


@pytest.mark.parametrize("action, code, fix", [("enospc", errno.ENOSPC, "nvme_dirs"),
                                               ("eio", errno.EIO, "check the drive")])  # fmt: skip
def test_write_back_error_names_the_fix_and_surfaces_on_the_main_thread(
    tmp_path, armed, action, code, fix
):
    """The 3rd page written back fails: the host worker job that evicted it raises an error
    naming the fix, and every later job (a gather after a lost write-back must not read stale
    rows) and wait() fail too."""
    store = _store([tmp_path])
    worker = HostWorker()  # not the process's HOST_WORKER: a failed job poisons its worker
    armed(f"nvme.page_write:3:{action}")
    job = worker.submit(store.load, {"weight": torch.randn(5000, 8), "sum": torch.rand(5000)})
    with pytest.raises(OSError, match=f"writing a page back to {store.paths[0]}.*{fix}") as e:
        job.result()
    assert e.value.errno == code and "resume from the last checkpoint" in str(e.value)
    later = worker.submit(store.read_rows, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="an earlier host-table job failed"):
        later.result()
    with pytest.raises(OSError, match=fix):
        worker.wait()
    store.close()
    store.remove_files()


def test_a_page_changed_behind_the_store_stops_it_by_name(tmp_path):
    """A page file overwritten while its store is live (here: random bytes over page 7 and
    page 30, the way the outside battery overwrote a live run's files): the next read of either
    page, a demand load on the worker and a page-in ahead, raises an error naming the file, the
    page, the table, its rows and the resume; pages read intact still come back exact."""
    from engram.rowstore.page_sums import PageChecksumError, page_sums

    store = _store([tmp_path], name="layer1_table", cache_pages=8)  # 113 rows a page, 45 pages
    w, s = torch.randn(5000, 8), torch.rand(5000)
    store.load({"weight": w, "sum": s})
    store.flush()
    rpp = store.rows_per_page
    store.read_rows(torch.arange(10 * rpp, 18 * rpp, rpp))  # pages 10-17 cached: 7, 30 are not
    for page in (7, 30):  # one a demand load reads, one a page-in reads
        with open(store.paths[0], "r+b") as f:
            f.seek(page * store.page_bytes)
            f.write(os.urandom(store.page_bytes))
            f.flush()
            os.fsync(f.fileno())
    assert torch.equal(store.read_rows(torch.tensor([3 * rpp + 1])), w[[3 * rpp + 1]])
    worker = HostWorker()
    job = worker.submit(store.read_rows, torch.tensor([7 * rpp + 2]))
    with pytest.raises(PageChecksumError) as e:
        job.result()
    for part in (f"table layer1_table: page 7 of {store.paths[0]}",
                 f"rows {7 * rpp}-{8 * rpp - 1} of the table", "checksum mismatch",
                 "the checkpoint is the record: resume from the last checkpoint"):  # fmt: skip
        assert part in str(e.value), (part, str(e.value))
    store.page_in_now(torch.tensor([30 * rpp]))
    with pytest.raises(PageChecksumError, match="page 30 of"):
        store.read_rows(torch.tensor([30 * rpp]))
    # the checksum: modulo-2^64 wrap-around as in integer arithmetic, and the page in it
    page = torch.randint(-(2**62), 2**62, (1, 512), dtype=torch.int64)
    keys = __import__("engram.rowstore.page_sums", fromlist=["_keys"])._keys(512).tolist()
    want = sum(a * b for a, b in zip(page[0].tolist(), keys[:-1], strict=True)) + 5 * keys[-1]
    want = ((want % 2**64) >> 32) - (2**32 if (want % 2**64) >> 63 else 0)
    got = page_sums(page.view(torch.float32), torch.tensor([0]), torch.tensor([5]))
    assert int(got[0]) == want and int(page_sums(page.view(torch.float32), torch.tensor([0]),
                                                 torch.tensor([6]))[0]) != want  # fmt: skip
    store.close()
    store.remove_files()
