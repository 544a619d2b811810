"""DCP checkpointing on real gloo ranks: exact resume of an FSDP2 model with a row-sharded
DTensor table, per-rank loader/RNG state, crash safety, pruning, config mismatch errors."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# DTensor's first use imports torch._dynamo (~3 s); importing it here, before the launcher forks,
# pays that once instead of in every rank of every test.
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint as dcp
from launcher import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from engram.checkpoint import (
    CheckpointError,
    CheckpointManager,
    ModelState,
    OptimizerState,
    TrainState,
)
from engram.config import Checkpoint
from engram.optim.builder import SchedulersState

TABLE_ROWS = 1009  # prime: uneven row shards (505 / 504 at world 2)
FINGERPRINT = {"model": {"dim": 8, "layers": 2}, "engram": {"layer_ids": [1], "rows": TABLE_ROWS}}


class Toy(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.table = nn.Parameter(distribute_tensor(torch.randn(TABLE_ROWS, 4), mesh, [Shard(0)]))

    def forward(self, x: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        local = self.table.to_local()
        return self.net(x) + local[hash_ids % local.shape[0]]


class CounterLoader:
    """Data-loader stand-in: its position differs per rank, like StatefulDataLoader's."""

    def __init__(self, rank: int):
        self.rank = rank
        self.position = 100 * rank

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.position)
        self.position += 1
        return torch.randn(4, 8, generator=g), torch.randint(0, 10**6, (4,), generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class Trainer:
    def __init__(self, rank: int, world_size: int, seed: int, cfg: Checkpoint, run: Path):
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(seed)
        self.model = Toy(mesh)
        for layer in self.model.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh, ignored_params={self.model.table})
        self.opts = [
            torch.optim.AdamW(self.model.net.parameters(), lr=1e-2),
            torch.optim.AdamW([self.model.table], lr=5e-2, weight_decay=0.0),
        ]
        self.scheds = [
            torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in self.opts
        ]
        self.loader = CounterLoader(rank)
        self.train_state = TrainState()
        states = {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.opts),
            "lr_scheduler": SchedulersState(self.scheds),
            "dataloader": self.loader,
            "train_state": self.train_state,
        }
        self.ckpt = CheckpointManager(cfg, run, states, FINGERPRINT)

    def step(self) -> float:
        x, ids = self.loader.next_batch()
        # Draw from every global RNG so that a resume is exact only if all of them are restored.
        x = x + 0.01 * torch.randn_like(x) + random.random() * 0.01
        ids = ids + int(np.random.randint(0, 7))
        loss = self.model(x, ids).pow(2).mean()
        loss.backward()
        for o, s in zip(self.opts, self.scheds, strict=True):
            o.step()
            o.zero_grad()
            s.step()
        self.train_state.step += 1
        self.train_state.tokens_seen += 4 * x.shape[1]
        return loss.item()

    def full_weights(self) -> dict[str, np.ndarray]:
        # numpy, not tensors: tensors sent through the launcher's queue share file descriptors
        # that die with the worker process.
        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
            for n, p in self.model.named_parameters()
        }


def _rng_draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def _first_run(rank: int, world_size: int, run: Path) -> dict[str, Any]:
    t = Trainer(rank, world_size, 0, Checkpoint(enable=True, interval=3, keep_latest_k=0), run)
    assert t.ckpt.load() == 0
    out: dict[str, Any] = {"losses": []}
    for step in range(1, 7):
        loss = t.step()
        if step > 3:
            out["losses"].append(loss)
        saved = t.ckpt.maybe_save(step, last_step=step == 6)
        assert saved == (step in (3, 6))
        if step == 3:
            out["position"] = t.loader.position
            out["rng"] = _rng_draws()
    out["weights"] = t.full_weights()
    out["lr"] = [s.get_last_lr() for s in t.scheds]
    return out


def _resume(rank: int, world_size: int, run: Path) -> dict[str, Any]:
    cfg = Checkpoint(enable=True, interval=3, keep_latest_k=0, load_step=3)
    t = Trainer(rank, world_size, 1, cfg, run)  # other init seed: the load must overwrite
    before = t.full_weights()
    assert t.ckpt.load() == 3
    out: dict[str, Any] = {"position": t.loader.position, "rng": _rng_draws()}
    out["train_state"] = (t.train_state.step, t.train_state.tokens_seen)
    out["changed"] = not np.array_equal(before["table"], t.full_weights()["table"])
    out["losses"] = [t.step() for _ in range(3)]
    out["weights"] = t.full_weights()
    out["lr"] = [s.get_last_lr() for s in t.scheds]
    return out


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    return run, run_distributed(_first_run, 2, run)


def test_resume_is_exact(first_run):
    run, first = first_run
    folder = run / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-3", "step-6"]
    assert (folder / "latest").read_text().strip() == "6"
    keys = set(dcp.FileSystemReader(folder / "step-3").read_metadata().state_dict_metadata)
    assert "train_state.step" in keys and "model.table" in keys
    assert not any(k.startswith(("dataloader", "rng")) for k in keys)
    # Per-rank states are plain JSON files, listed in the manifest with the DCP files.
    manifest = json.loads((folder / "step-3" / "manifest.json").read_text())
    for name in ("dataloader", "rng"):
        for rank in range(2):
            assert f"{name}.rank{rank}.json" in manifest["files"]
    assert json.loads((folder / "step-3" / "dataloader.rank1.json").read_text()) == {
        "position": 103
    }
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"} <= set(manifest["files"])

    resumed = run_distributed(_resume, 2, run)
    for rank in range(2):
        a, b = first[rank], resumed[rank]
        assert b["changed"]
        assert b["train_state"] == (3, 3 * 4 * 8)
        assert b["position"] == a["position"] == 100 * rank + 3  # each rank's own loader
        assert b["rng"] == a["rng"]
        assert b["losses"] == a["losses"]
        assert b["lr"] == a["lr"]
        assert a["weights"].keys() == b["weights"].keys()
        for name in a["weights"]:
            assert np.array_equal(a["weights"][name], b["weights"][name]), name


def _load_at_world(rank: int, world_size: int, run: Path) -> str:
    t = Trainer(rank, world_size, 0, Checkpoint(enable=True), run)
    with pytest.raises(CheckpointError) as e:
        t.ckpt.load()
    return str(e.value)


def test_world_size_change_is_a_clear_error(first_run):
    run, _ = first_run
    (msg,) = run_distributed(_load_at_world, 1, run)
    assert "saved by 2 ranks but this run has 1" in msg and "'dataloader' state differs" in msg


def _crash_and_prune(rank: int, world_size: int, run: Path) -> dict[str, Any]:
    t = Trainer(rank, world_size, 0, Checkpoint(enable=True, interval=2, keep_latest_k=2), run)
    for step in range(1, 7):
        t.step()
        t.ckpt.maybe_save(step)
    weights = t.full_weights()
    steps_before = t.ckpt.complete_steps()
    t.step()
    t.step()
    real_save = dcp.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)  # shards and .metadata written, folder not yet committed
        raise KeyboardInterrupt("simulated crash during save")

    dcp.save = save_then_die
    try:
        with pytest.raises(KeyboardInterrupt):
            t.ckpt.maybe_save(8)
    finally:
        dcp.save = real_save
    return {"weights": weights, "steps_before": steps_before}


def _after_crash(rank: int, world_size: int, run: Path) -> dict[str, Any]:
    cfg = Checkpoint(enable=True, interval=2, keep_latest_k=2)
    t = Trainer(rank, world_size, 1, cfg, run)
    with pytest.raises(CheckpointError) as e:  # step-9 is newest and has no manifest
        t.ckpt.load()
    cfg.on_damaged = "previous"
    return {
        "error": str(e.value),
        "step": t.ckpt.load(),
        "weights": t.full_weights(),
        "steps": t.ckpt.complete_steps(),
    }


def test_interrupted_save_keeps_last_good_checkpoint(tmp_path):
    crashed = run_distributed(_crash_and_prune, 2, tmp_path)
    folder = tmp_path / "checkpoint"
    assert crashed[0]["steps_before"] == [4, 6]  # keep_latest_k=2 pruned step-2
    assert (folder / "step-8.tmp" / ".metadata").is_file()
    assert (folder / "latest").read_text().strip() == "6"
    # Other debris: a half-written folder from some other crash, an incomplete step folder.
    (folder / "step-10.tmp").mkdir()
    (folder / "step-10.tmp" / "__0_0.distcp").write_bytes(b"garbage")
    (folder / "step-9").mkdir()

    resumed = run_distributed(_after_crash, 2, tmp_path)
    for rank in range(2):
        assert "step-9: manifest.json is missing" in resumed[rank]["error"]
        assert resumed[rank]["step"] == 6
        assert resumed[rank]["steps"] == [4, 6]
        for name, w in crashed[rank]["weights"].items():
            assert np.array_equal(w, resumed[rank]["weights"][name]), name
    assert not list(folder.glob("*.tmp"))
    assert (folder / "step-9").is_dir()  # unreadable: never deleted


def _save_then_load_other(rank: int, world_size: int, run: Path) -> list[str]:
    t = Trainer(rank, world_size, 0, Checkpoint(enable=True, interval=1), run)
    t.step()
    t.ckpt.maybe_save(1)
    errors = []
    other = {"model": {"dim": 16, "layers": 2}, "engram": {"layer_ids": [1, 3], "rows": TABLE_ROWS}}
    t.ckpt.fingerprint = other
    with pytest.raises(CheckpointError) as e:
        t.ckpt.load()
    errors.append(str(e.value))
    t.ckpt.fingerprint = FINGERPRINT
    t.ckpt.cfg = Checkpoint(enable=True, load_step=5)
    with pytest.raises(CheckpointError) as e:
        t.ckpt.load()
    errors.append(str(e.value))
    # Saving a step that already exists (resumed from an older one) replaces it.
    t.ckpt.cfg = Checkpoint(enable=True, interval=1)
    t.step()
    t.ckpt.save(1)
    replaced = t.full_weights()
    assert t.ckpt.complete_steps() == [1] and not list(t.ckpt.folder.glob("*.tmp"))
    t.step()
    assert t.ckpt.load() == 1
    for name, w in replaced.items():
        assert np.array_equal(w, t.full_weights()[name]), name
    return errors


def test_mismatch_errors_name_the_problem(tmp_path):
    (errors,) = run_distributed(_save_then_load_other, 1, tmp_path)
    fingerprint, missing_step = errors
    assert "model.dim: checkpoint 8, this run 16" in fingerprint
    assert "engram.layer_ids: checkpoint [1], this run [1, 3]" in fingerprint
    assert "model.layers" not in fingerprint
    assert "job.run_name" in fingerprint
    assert "load_step=5" in missing_step and "[1]" in missing_step


def test_disabled_manager_does_nothing(tmp_path):
    mgr = CheckpointManager(Checkpoint(enable=False), tmp_path, {}, {})
    assert mgr.load() == 0
    assert not mgr.maybe_save(500, last_step=True)
    assert not any(tmp_path.iterdir())


def test_non_stateful_state_is_rejected(tmp_path):
    with pytest.raises(TypeError, match="state_dict"):
        CheckpointManager(Checkpoint(enable=True), tmp_path, {"model": nn.Linear(2, 2).weight}, {})


def _async_run(rank: int, world_size: int, run: Path, crash: bool) -> dict[str, Any]:
    cfg = Checkpoint(enable=True, interval=3, keep_latest_k=0, async_mode="async")
    t = Trainer(rank, world_size, 0, cfg, run)
    out: dict[str, Any] = {"losses": []}
    for step in range(1, 7):
        out["losses"].append(t.step())
        if crash and step == 5:
            # Crash while the step-3 async save may still be writing: never committed.
            out["pending"] = t.ckpt._pending is not None
            out["complete"] = t.ckpt.complete_steps()
            return out
        t.ckpt.maybe_save(step, last_step=step == 6)
        if step == 3:
            _rng_draws()  # as _first_run does: _resume draws the same after its load
            out["pending"] = t.ckpt._pending is not None
            out["complete_at_3"] = t.ckpt.complete_steps()
    out["complete"] = t.ckpt.complete_steps()
    return out


def test_async_save_commits_at_the_next_save_and_resumes_exactly(tmp_path):
    runs = run_distributed(_async_run, 2, tmp_path, False)
    for rank in range(2):
        assert runs[rank]["pending"] and runs[rank]["complete_at_3"] == []
        assert runs[rank]["complete"] == [3, 6]
    # Step 3 was written while steps 4-6 changed the weights: it must hold the step-3 state.
    resumed = run_distributed(_resume, 2, tmp_path)
    for rank in range(2):
        assert resumed[rank]["losses"] == runs[rank]["losses"][3:]
        assert resumed[rank]["position"] == 100 * rank + 3


def test_crash_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    crashed = run_distributed(_async_run, 2, tmp_path, True)
    assert crashed[0]["pending"] and crashed[0]["complete"] == []
    assert not (tmp_path / "checkpoint" / "step-3").exists()
    (step,) = {s["step"] for s in run_distributed(_after_crash_async, 2, tmp_path)}
    assert step == 0  # nothing committed: a fresh start, the leftover removed
    assert not list((tmp_path / "checkpoint").glob("*.tmp"))


def _after_crash_async(rank: int, world_size: int, run: Path) -> dict[str, Any]:
    t = Trainer(rank, world_size, 1, Checkpoint(enable=True), run)
    return {"step": t.ckpt.load()}
