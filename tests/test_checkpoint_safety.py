"""A checkpoint holds no pickled items, and loading a crafted one runs no code from it: DCP's
`.metadata` is read with an unpickler restricted to DCP's metadata classes, and a non-tensor
item with torch's weights-only unpickler. Single process (DCP without a process group)."""

from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from engram.checkpoint import (
    CheckpointError,
    CheckpointManager,
    ModelState,
    OptimizerState,
    TrainState,
    file_checksum,
)
from engram.config import Checkpoint
from engram.optim.builder import SchedulersState

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _manager(folder: Path, load_step: int = -1) -> CheckpointManager:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    states = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, opt),
        "lr_scheduler": SchedulersState([sched]),
        "train_state": TrainState(step=1),
    }
    cfg = Checkpoint(enable=True, interval=1, keep_latest_k=0, load_step=load_step)
    return CheckpointManager(cfg, folder, states, {"fp": 1}, per_rank=(), save_rng=False)


def _reseal(step_dir: Path, name: str) -> None:
    """Rewrite the manifest entry of a tampered file (a forger can do that: CRC is no MAC)."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    f = step_dir / name
    manifest["files"][name] = {"size": f.stat().st_size, "crc32": file_checksum(f)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


class _Payload:
    """Unpickling this writes a marker file (stands for arbitrary code)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _metadata(step_dir: Path):
    with (step_dir / ".metadata").open("rb") as f:
        return pickle.load(f)  # the test's own, trusted file


def test_checkpoint_has_no_pickled_items(tmp_path):
    _manager(tmp_path).save(1)
    md = _metadata(tmp_path / "checkpoint" / "step-1")
    pickled = [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    assert pickled == []
    assert "lr_scheduler.last_epoch" in md.state_dict_metadata
    assert not any(k.startswith("optimizer.param_groups") for k in md.state_dict_metadata)
    assert _manager(tmp_path, load_step=1).load() == 1


def test_malicious_metadata_runs_no_code_and_is_refused(tmp_path):
    _manager(tmp_path).save(1)
    step_dir = tmp_path / "checkpoint" / "step-1"
    marker = tmp_path / "ran"
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _reseal(step_dir, ".metadata")
    with pytest.raises(CheckpointError, match="not a DCP metadata class"):
        _manager(tmp_path, load_step=1).load()
    assert not marker.exists()


def test_malicious_item_runs_no_code_and_is_refused(tmp_path):
    _manager(tmp_path).save(1)
    step_dir = tmp_path / "checkpoint" / "step-1"
    marker = tmp_path / "ran"
    # The schedule's step becomes a pickled item whose bytes run code when unpickled (the
    # metadata itself holds only DCP's classes, so the restricted unpickler accepts it).
    md = _metadata(step_dir)
    key = "lr_scheduler.last_epoch"
    payload = pickle.dumps(_Payload(marker))
    (step_dir / "__9_0.distcp").write_bytes(payload)
    info = next(v for k, v in md.storage_data.items() if k.fqn == key)
    info.relative_path, info.offset, info.length = "__9_0.distcp", 0, len(payload)
    md.storage_data = {
        (MetadataIndex(key) if k.fqn == key else k): v for k, v in md.storage_data.items()
    }
    md.state_dict_metadata[key] = BytesStorageMetadata()
    buf = io.BytesIO()
    pickle.dump(md, buf)
    (step_dir / ".metadata").write_bytes(buf.getvalue())
    for name in (".metadata", "__9_0.distcp"):
        _reseal(step_dir, name)
    with pytest.raises(CheckpointError, match="pickled object"):
        _manager(tmp_path, load_step=1).load()
    assert not marker.exists()


def test_full_disk_reported_whatever_the_writer_says(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as "file write failed", not ENOSPC: the message
    still says so, with the free and the needed bytes, and keeps the previous checkpoint."""
    import shutil
    from collections import namedtuple

    import engram.checkpoint.manager as ckpt

    manager = _manager(tmp_path)
    manager.save(1)

    def full(*args, **kwargs):
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.dcp, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 4096))
    with pytest.raises(CheckpointError) as e:
        manager.save(2)
    msg = str(e.value)
    assert "no space left on the device (0.0 MiB free, the previous checkpoint took" in msg, msg
    assert "file write failed" in msg and "step-2.tmp" in msg
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["latest", "step-1"]


def test_pruning_deletes_only_what_the_manifest_lists(tmp_path, caplog):
    manager = _manager(tmp_path)
    manager.cfg.keep_latest_k = 1
    manager.save(1)
    folder = tmp_path / "checkpoint"
    (folder / "step-1" / "eval_results.json").write_text("{}")
    with caplog.at_level("WARNING", logger="engram"):
        manager.save(2)
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-1.pruned", "step-2"]
    assert [p.name for p in (folder / "step-1.pruned").iterdir()] == ["eval_results.json"]
    assert "eval_results.json" in caplog.text
    manager.save(3)  # a clean checkpoint is removed entirely
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-1.pruned", "step-3"]


class _NestedFolderState:
    """Writes files in sub-folders, as a DeepSpeed engine's checkpoint does."""

    def save(self, folder: Path) -> None:
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "states.pt").write_bytes(b"x")

    def load(self, folder: Path) -> None:
        pass


def test_files_added_to_the_manifest_are_verified_and_pruned(tmp_path):
    """add_to_manifest (a derived copy, such as a DeepSpeed universal checkpoint, added to a
    committed step): its files are verified like the rest and pruned with the step, nested
    folders included."""
    from engram.checkpoint import add_to_manifest, verify_checkpoint

    manager = _manager(tmp_path)
    manager.folder_states = {"engine": _NestedFolderState()}
    manager.cfg.keep_latest_k = 1
    step1 = manager.save(1)
    extra = step1 / "engine" / "converted" / "zero" / "w"
    extra.mkdir(parents=True)
    (extra / "fp32.pt").write_bytes(b"abc")
    add_to_manifest(step1, ["engine/converted/zero/w/fp32.pt"])
    assert not verify_checkpoint(step1, collective=False)
    (extra / "fp32.pt").write_bytes(b"abd")
    (problem,) = verify_checkpoint(step1, collective=False)
    assert "engine/converted/zero/w/fp32.pt has checksum" in problem, problem
    manager.save(2)  # prunes step-1 whole: no step-1.pruned with empty folders
    assert sorted(p.name for p in manager.folder.iterdir()) == ["latest", "step-2"]
