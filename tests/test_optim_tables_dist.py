"""Engram table optimizers across real gloo ranks (tests/launcher.py):

- the all-to-all lookup's row-sparse backward: no dense .grad, the owner's rows equal the dense
  gradient's, the clipped global norm equals the dense path's;
- run-level parity of lazy_adam and rowwise_adagrad at 1 vs 2 vs 4 ranks (FSDP, DDP, grad
  accumulation; losses, grad norms, updated weights; tests/test_parallelisms_parity.py's helpers and
  tolerances; `adam` is covered by test_parallelisms_parity.py's layouts);
- resume from a DCP checkpoint replays the uninterrupted run exactly (1 and 2 ranks);
- every table optimizer's state is DTensor Shard(0) and reshards: saved at 2 ranks, loaded at 1
  and 4 ranks, equal to what was saved.
"""

from __future__ import annotations

import pytest
import torch
from launcher import run_distributed
from shared_runs import shared_run
from small_job import small_job
from test_parallelisms_parity import (
    _assert_matches,
    _config,
    _initial_weights,
    _local_batch,
    _train,
    _with,
)
from torch import nn

from engram.config import config_from_dict
from engram.config.table_optimizers import TABLE_OPTIMIZERS
from engram.models.engram import EngramTable
from engram.models.table_grad import row_grad
from engram.optim.builder import build_table_optimizer, clip_grad_norm_
from parallelisms.engram_tables import apply_engram_table_sharding, local_row_range

ROWS, DIM = 211, 6
ROW_SPARSE = tuple(name for name, spec in TABLE_OPTIMIZERS.items() if spec.row_sparse)


def _tables(seed: int) -> nn.ModuleList:
    gen = torch.Generator().manual_seed(seed)
    tables = nn.ModuleList([EngramTable(ROWS, DIM), EngramTable(ROWS, DIM)])
    with torch.no_grad():
        for t in tables:
            t.weight.copy_(torch.randn(ROWS, DIM, generator=gen))
    return tables


def _rank_batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + micro)
    # ids concentrated on the first rows: some ranks own no touched row of some micro-batch
    return torch.randint(0, ROWS // 3, (3, 5, 2), generator=gen), torch.randn(
        3, 5, 2, DIM, generator=gen
    )


def _loss(tables: nn.ModuleList, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return sum(((t(ids).tanh() * target).sum() / 5.0) for t in tables)


def _sharded_grads_worker(rank: int, world: int, name: str) -> dict:
    """Dense vs row-sparse backward of the sharded lookup, two micro-batches, then clip."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind in ("dense", name):
        tables = _tables(seed=1)
        params = apply_engram_table_sharding(
            tables, mesh, grad_scale=1.0 / world, row_sparse=kind != "dense"
        )
        if kind != "dense":
            build_table_optimizer(
                kind, [{"params": params, "lr": 1e-2, "weight_decay": 0.0}], (0.9, 0.95), 1e-8
            )
        for micro in range(2):
            (_loss(tables, *_rank_batch(rank, micro)) / 2).backward()
        out[f"{kind}_norm"] = clip_grad_norm_(params, max_norm=0.1)
        if kind == "dense":
            dense = [p.grad.to_local().clone() for p in params]
        else:
            assert all(p.grad is None for p in params)
            for p, g in zip(params, dense, strict=True):
                rows, values = row_grad(p)
                torch.testing.assert_close(values, g[rows], rtol=1e-5, atol=1e-8)
                rest = torch.ones(g.shape[0], dtype=torch.bool)
                rest[rows] = False
                assert not g[rest].any()
    return out


@pytest.mark.slow
def test_sharded_row_sparse_grads_and_clip_norm_equal_dense_path():
    for world in (2, 4):
        for got in run_distributed(_sharded_grads_worker, world, "lazy_adam"):
            assert got["dense_norm"] > 0.1
            torch.testing.assert_close(got["lazy_adam_norm"], got["dense_norm"], rtol=1e-6, atol=0)


# label -> (world size, parallelism section, other config sections) per table optimizer
PARITY = {
    "lazy_adam": [
        ("fsdp_grad_accum", 2, {"dp_shard": 2}, {"training": {"grad_accum_steps": 2}}),
        ("ddp", 4, {"dp_replicate": 4, "dp_shard": 1}, {}),
    ],
    "rowwise_adagrad": [
        (
            "ddp_grad_accum",
            2,
            {"dp_replicate": 2, "dp_shard": 1},
            {"training": {"grad_accum_steps": 2}},
        ),
        ("fsdp", 4, {"dp_shard": 4}, {}),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ROW_SPARSE)
def test_table_optimizer_parity_1_2_4_ranks(tmp_path, name):
    # The first 3 steps (team guide): measured with lazy_adam, one process with vs without grad
    # accumulation already differs by 7e-6 in the step-5 loss and by half a table step in a table
    # weight (Adam's m / sqrt(v) amplifies fp32 summation-order noise in near-zero gradients).
    opt = {"optimizer": {"table_optimizer": name}, "training": {"steps": 3}}
    base = _with(_config(str(tmp_path / "ref"), 1, "full", {}), opt)
    init = _initial_weights(base)
    ref = shared_run(_train, 1, base)[0]
    assert ref["losses"][-1] < ref["losses"][0], "reference run did not learn"
    tables = [n for n in init if ".table." in n]
    assert all((ref["weights"][n] != init[n]).any() for n in tables)
    for label, world, layout, extra in PARITY[name]:
        sections = {**opt, **extra, "training": {**opt["training"], **extra.get("training", {})}}
        raw = _with(_config(str(tmp_path / label), world, "full", layout), sections)
        raw["training"]["local_batch_size"] = _local_batch(world, extra)
        for rank, got in enumerate(run_distributed(_train, world, raw)):
            _assert_matches(got, ref, init, f"{name} {label} (world {world}, rank {rank})")


def _resume_raw(folder: str, world: int, name: str, load_step: int) -> dict:
    extra = {
        "job": {"seed": 5},
        "training": {"local_batch_size": 4 // world},
        "optimizer": {"lr": 3e-4, "table_optimizer": name},
        "lr_scheduler": {"warmup_steps": 1},
        "checkpoint": {"enable": True, "interval": 2, "keep_latest_k": 0, "load_step": load_step},
        "metrics": {"log_freq": 1},
    }
    return small_job(folder, "resume", world, 4, extra)


def _train_losses(rank: int, world: int, raw: dict) -> dict:
    from recipes.train import train

    result = train(config_from_dict(raw))
    return {"losses": result.losses, "start_step": result.start_step}


@pytest.mark.slow
@pytest.mark.parametrize("name", ROW_SPARSE)
@pytest.mark.parametrize("world", [1, 2])
def test_resume_replays_uninterrupted_run_exactly(tmp_path, name, world):
    full = run_distributed(_train_losses, world, _resume_raw(str(tmp_path), world, name, -1))
    resumed = run_distributed(_train_losses, world, _resume_raw(str(tmp_path), world, name, 2))
    for rank in range(world):
        assert resumed[rank]["start_step"] == 2
        assert resumed[rank]["losses"] == full[rank]["losses"][2:]


SAVE_WORLD = 2


def _state_dict_worker(rank: int, world: int, name: str, path: str, save: bool) -> dict:
    """Train 2 steps at SAVE_WORLD and DCP-save model + optimizer; at `world`, load into a fresh
    model and optimizer. Returns the loaded full state tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from engram.checkpoint import OptimizerState

    mesh = init_device_mesh("cpu", (world,))

    def build():
        tables = _tables(seed=2)
        params = apply_engram_table_sharding(
            tables, mesh, grad_scale=1.0 / world, row_sparse=TABLE_OPTIMIZERS[name].row_sparse
        )
        opt = build_table_optimizer(
            name, [{"params": params, "lr": 1e-2, "weight_decay": 0.0}], (0.9, 0.95), 1e-8
        )
        return tables, params, opt

    if save:
        tables, params, opt = build()
        for step in range(2):
            _loss(tables, *_rank_batch(rank, step)).backward()
            opt.step()
            opt.zero_grad()
        for p in params:
            for value in opt.state[p].values():
                if value.dim() > 0:
                    assert isinstance(value, DTensor) and value.placements == (Shard(0),)
        dcp.save(
            {"model": tables.state_dict(), "optim": OptimizerState(tables, [opt])},
            checkpoint_id=path,
        )
    tables, params, opt = build()
    with torch.no_grad():
        for p in params:
            p.to_local().zero_()
    optim_state = OptimizerState(tables, [opt])
    state = {"model": tables.state_dict(), "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    tables.load_state_dict(state["model"])
    out = {}
    for i, p in enumerate(params):
        out[f"weight.{i}"] = p.full_tensor()
        start, stop = local_row_range(ROWS, rank, world)
        assert p.to_local().shape[0] == stop - start
        for key, value in opt.state[p].items():
            out[f"{key}.{i}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ROW_SPARSE)
def test_optimizer_state_reshards_2_to_1_and_4_ranks(tmp_path, name):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_state_dict_worker, SAVE_WORLD, name, path, True)[0]
    assert any(k.startswith(("exp_avg.", "sum.")) for k in saved)
    for world in (1, 4):
        for got in run_distributed(_state_dict_worker, world, name, path, False):
            assert got.keys() == saved.keys()
            for key, want in saved.items():
                assert (got[key] == want).all(), (world, key)
