"""Fault injection on checkpoints: damaged, incomplete and unreadable files, unrelated files in
the folder, a full disk during save, a non-finite model. Each asserts what the run does: a clear
error naming the checkpoint, the file and the problem (or a loud fallback with
checkpoint.on_damaged = "previous"), and a folder left exactly as it was."""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from launcher import run_distributed
from test_checkpoint import Trainer

from engram.checkpoint import CheckpointError, verify_checkpoint
from engram.config import Checkpoint


def _save_steps(rank: int, world_size: int, run: Path, folder: str) -> None:
    t = Trainer(
        rank,
        world_size,
        0,
        Checkpoint(enable=True, interval=2, keep_latest_k=0, folder=folder),
        run,
    )
    for step in range(1, 5):
        t.step()
        t.ckpt.maybe_save(step)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run folder with intact checkpoints step-2 and step-4 (world 1)."""
    run = tmp_path_factory.mktemp("saved")
    run_distributed(_save_steps, 1, run, "checkpoint")
    return run


def _snapshot(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(folder))] = "link:" + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p.relative_to(folder))] = "dir"
    return out


def _try_load(rank: int, world_size: int, run: Path, cfg: Checkpoint) -> dict[str, Any]:
    t = Trainer(rank, world_size, 1, cfg, run)
    try:
        step = t.ckpt.load()
    except CheckpointError as e:
        return {"error": str(e)}
    return {"step": step, "train_step": t.train_state.step}


def _copy(saved: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved, run, symlinks=True)
    return run


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip_bytes(p: Path) -> None:
    data = bytearray(p.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0x5A for b in data[mid : mid + 64])
    p.write_bytes(bytes(data))


def _unreadable(p: Path) -> None:
    p.unlink()
    os.symlink(p.name, p)  # a symlink to itself: every open fails (ELOOP), even as root


DAMAGES = {
    "truncated_shard": ("__0_0.distcp", _truncate, "bytes, the manifest says"),
    "changed_bytes": ("__0_0.distcp", _flip_bytes, "damaged bytes"),
    "missing_manifest": ("manifest.json", Path.unlink, "manifest.json is missing"),
    "missing_metadata": (".metadata", Path.unlink, "file .metadata is missing"),
    "missing_meta": ("meta.json", Path.unlink, "file meta.json is missing"),
    "missing_loader_state": ("dataloader.rank0.json", Path.unlink, "is missing"),
    "unreadable_file": ("__0_0.distcp", _unreadable, "cannot be read"),
}


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_damaged_newest_checkpoint(saved, tmp_path, case):
    name, damage, expected = DAMAGES[case]
    run = _copy(saved, tmp_path)
    folder = run / "checkpoint"
    damage(folder / "step-4" / name)
    before = _snapshot(folder)

    (refused,) = run_distributed(_try_load, 1, run, Checkpoint(enable=True))
    msg = refused["error"]
    assert "step-4" in msg and name in msg and expected in msg, msg
    assert "on_damaged" in msg
    assert _snapshot(folder) == before  # a refused load changes nothing

    cfg = Checkpoint(enable=True, on_damaged="previous", keep_latest_k=1, interval=1)
    (fallback,) = run_distributed(_try_load, 1, run, cfg)
    assert fallback == {"step": 2, "train_step": 2}
    assert _snapshot(folder) == before  # the damaged one is kept for inspection


def _load_then_save(rank: int, world_size: int, run: Path, cfg: Checkpoint) -> dict[str, Any]:
    t = Trainer(rank, world_size, 1, cfg, run)
    step = t.ckpt.load()
    for s in range(step + 1, step + 3):
        t.step()
        t.ckpt.maybe_save(s)
    return {"step": step, "steps": t.ckpt.complete_steps()}


def test_fallback_never_overwrites_or_prunes_a_damaged_checkpoint(saved, tmp_path):
    run = _copy(saved, tmp_path)
    folder = run / "checkpoint"
    _flip_bytes(folder / "step-4" / "__0_0.distcp")
    damaged = _snapshot(folder / "step-4")
    cfg = Checkpoint(enable=True, on_damaged="previous", keep_latest_k=1, interval=1)
    (out,) = run_distributed(_load_then_save, 1, run, cfg)
    # Resumed at 2, saved 3 and 4: step-4 is the new one, the damaged one moved aside intact.
    assert out == {"step": 2, "steps": [4]}
    (aside,) = folder.glob("step-4.unreadable-*")
    assert _snapshot(aside) == damaged
    assert verify_checkpoint(folder / "step-4") == []


def test_no_intact_checkpoint_never_starts_from_zero(saved, tmp_path):
    run = _copy(saved, tmp_path)
    folder = run / "checkpoint"
    (folder / "step-2" / "meta.json").unlink()  # shards and DCP metadata still intact
    (folder / "step-4" / "meta.json").unlink()
    before = _snapshot(folder)
    (out,) = run_distributed(_try_load, 1, run, Checkpoint(enable=True, on_damaged="previous"))
    assert "none is intact" in out["error"] and "load_step = 0" in out["error"], out
    assert _snapshot(folder) == before
    # The user says so explicitly: a fresh start, and the old checkpoints stay.
    (fresh,) = run_distributed(_try_load, 1, run, Checkpoint(enable=True, load_step=0))
    assert fresh == {"step": 0, "train_step": 0}
    assert _snapshot(folder) == before


def test_load_step_names_the_damage(saved, tmp_path):
    run = _copy(saved, tmp_path)
    _truncate(run / "checkpoint" / "step-2" / "__0_0.distcp")
    cfg = Checkpoint(enable=True, load_step=2, on_damaged="previous")
    (out,) = run_distributed(_try_load, 1, run, cfg)
    assert "step-2" in out["error"] and "__0_0.distcp" in out["error"]


def test_unrelated_files_in_an_absolute_folder_are_left_alone(tmp_path):
    shared = tmp_path / "shared_dir"
    shared.mkdir()
    (shared / "notes.tmp").write_text("mine")
    (shared / "scratch.tmp").mkdir()
    (shared / "scratch.tmp" / "x.bin").write_bytes(b"1")
    (shared / "step-7.tmp").mkdir()  # our naming, but a file we never write inside
    (shared / "step-7.tmp" / "thesis.tex").write_text("do not delete")
    (shared / "latest.txt").write_text("other tool")
    before = _snapshot(shared)
    run = tmp_path / "run"
    run_distributed(_save_steps, 1, run, str(shared))  # absolute checkpoint.folder
    (out,) = run_distributed(_try_load, 1, run, Checkpoint(enable=True, folder=str(shared)))
    assert out["step"] == 4
    after = _snapshot(shared)
    assert {k: after[k] for k in before} == before
    assert not (run / "checkpoint").exists()


def _save_nonfinite(rank: int, world_size: int, run: Path) -> str:
    t = Trainer(rank, world_size, 0, Checkpoint(enable=True, interval=1), run)
    t.step()
    t.ckpt.save(1)
    with torch.no_grad():
        t.model.net[0].weight.to_local()[0, 0] = float("nan")
    with pytest.raises(CheckpointError) as e:
        t.ckpt.save(2)
    return str(e.value)


def test_non_finite_state_is_never_saved(tmp_path):
    msgs = run_distributed(_save_nonfinite, 2, tmp_path)
    for msg in msgs:
        assert "refusing to save step 2" in msg and "step-1" in msg
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["latest", "step-1"]


# ----------------------------------------------------------------------------- full disk


def _save_until_full(rank: int, world_size: int, run: Path, folder: str, filler: Path) -> dict:
    cfg = Checkpoint(enable=True, interval=1, keep_latest_k=0, folder=folder)
    t = Trainer(rank, world_size, 0, cfg, run)
    t.step()
    t.ckpt.save(1)
    if rank == 0:  # leave a few KiB: the next save cannot fit
        free = shutil.disk_usage(folder).free
        filler.write_bytes(b"\0" * max(free - 8192, 0))
    t.step()
    with pytest.raises(CheckpointError) as e:
        t.ckpt.save(2)
    return {"error": str(e.value)}


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root: the full-disk test did not run")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): test did not run")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_disk_full_during_save(tmp_path, small_tmpfs):
    folder = small_tmpfs / "ckpt"
    filler = small_tmpfs / "filler"
    outs = run_distributed(_save_until_full, 2, tmp_path, str(folder), filler)
    for out in outs:
        msg = out["error"]
        assert "no space left" in msg and str(folder / "step-2.tmp") in msg, msg
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-1"]  # partial removed
    assert verify_checkpoint(folder / "step-1") == []
    filler.unlink()
    cfg = Checkpoint(enable=True, folder=str(folder))
    assert run_distributed(_try_load, 2, tmp_path, cfg) == [{"step": 1, "train_step": 1}] * 2


class _ZipWrittenState:
    """A folder state written as DeepSpeed's engine writes its checkpoint: torch.save's zip
    writer, which reports a full disk as "unexpected pos A vs B", with no errno. `fill`: instead
    write up to `fill` bytes and raise that error (a disk of `fill` bytes, simulated)."""

    def __init__(self, numel: int, fill: int | None = None):
        self.numel, self.fill = numel, fill

    def save(self, folder: Path) -> None:
        folder.mkdir()
        if self.fill is not None:
            (folder / "model_states.pt").write_bytes(b"\0" * self.fill)
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
            )
        torch.save({"w": torch.zeros(self.numel)}, folder / "model_states.pt")

    def load(self, folder: Path) -> None:
        pass


def _first_save_fails(run: Path, engine: _ZipWrittenState, width: int = 4) -> str:
    """The run's first save (no previous checkpoint to size it by) of a `width` x `width`
    linear layer (DCP shards, written first) and `engine`; the error message."""
    import warnings

    from torch import nn

    from engram.checkpoint import CheckpointManager, ModelState

    cfg = Checkpoint(enable=True, interval=1, keep_latest_k=0)
    states = {"model": ModelState(nn.Linear(width, width, bias=False))}
    manager = CheckpointManager(
        cfg, run, states, {"fp": 1}, per_rank=(), save_rng=False, folder_states={"engine": engine}
    )
    with warnings.catch_warnings(), pytest.raises(CheckpointError) as e:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        manager.save(1)
    assert not (run / "checkpoint" / "step-1.tmp").exists()  # the partial save is removed
    msg = str(e.value)
    del e  # torch's failed zip writer, still open in the traceback's frames, lets go of the file
    gc.collect()
    return msg


def test_disk_full_in_torch_zip_writer_is_named(small_tmpfs):
    """The zip writer's "unexpected pos" on a real full disk (2 MiB tmpfs: 1.5
    MiB of DCP shards, then a 1 MiB engine file) is reported as a full disk with the free and
    written bytes: the free space is measured before the partial save is removed (after it,
    the shards' 1.5 MiB are free again and the disk does not look full)."""
    msg = _first_save_fails(small_tmpfs, _ZipWrittenState(numel=1 << 18), width=640)
    assert "unexpected pos" in msg and "no space left on the device (0.0 MiB free" in msg, msg
    assert "this save needed more than the" in msg and "step-1.tmp" in msg, msg


def test_disk_full_in_torch_zip_writer_simulated(tmp_path, monkeypatch):
    """The same without root: a simulated 2 MiB disk (free = 2 MiB minus the bytes under the
    run folder) that the engine file fills before torch's error."""
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")

    def disk_usage(path):
        used = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
        return usage(2 << 20, used, (2 << 20) - used)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    msg = _first_save_fails(tmp_path, _ZipWrittenState(0, fill=(2 << 20) - 8192))
    assert "unexpected pos 704 vs 598" in msg and "no space left on the device (" in msg, msg
    assert "this save needed more than the 2.0 MiB it had written" in msg, msg


def _save_read_only(rank: int, world_size: int, run: Path, folder: str) -> str:
    t = Trainer(rank, world_size, 0, Checkpoint(enable=True, interval=1, folder=folder), run)
    t.step()
    with pytest.raises(CheckpointError) as e:
        t.ckpt.save(1)
    return str(e.value)


def test_unwritable_folder_is_a_clear_error(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root: the unwritable-folder test did not run")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): test did not run")
    try:
        msgs = run_distributed(_save_read_only, 2, tmp_path, str(mnt / "ckpt"))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    for msg in msgs:
        assert str(mnt / "ckpt" / "step-1.tmp") in msg and "Read-only file system" in msg, msg


class _UnwritableState:
    """A per-rank JSON state whose write fails (a forced failure of the JSON-state save)."""

    def state_dict(self) -> dict:
        return {"bad": object()}  # not JSON-serialisable

    def load_state_dict(self, state: dict) -> None:
        pass


def test_failed_json_state_save_leaves_no_tmp_folder(tmp_path):
    """A save that fails writing a JSON state (after DCP wrote its shards) raises naming the
    state and removes its step-<N>.tmp/ at once, not at the next start."""
    import warnings

    from torch import nn

    from engram.checkpoint import CheckpointManager, ModelState

    cfg = Checkpoint(enable=True, interval=1, keep_latest_k=0)
    states = {"model": ModelState(nn.Linear(4, 4, bias=False)), "dataloader": _UnwritableState()}
    manager = CheckpointManager(cfg, tmp_path, states, {"fp": 1}, save_rng=False)
    with (
        warnings.catch_warnings(),
        pytest.raises(CheckpointError, match="'dataloader' is not JSON"),
    ):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        manager.save(1)
    assert not (tmp_path / "checkpoint" / "step-1.tmp").exists()
    assert not (tmp_path / "checkpoint" / "step-1").exists()
