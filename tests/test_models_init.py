"""Layout-independent init: every sharding of a tensor assembles to the single-process tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from launcher import run_distributed

from engram.config import Engram as EngramConfig
from engram.config import Model as ModelConfig
from engram.models import build_model
from engram.models import init as init_mod
from engram.models.init import CHUNK_NUMEL, chunk_rows, init_constant_, init_normal_

torch.set_num_threads(2)

# (shape, key): rows odd and several chunks per tensor, with a chunk boundary inside each shard.
# The sharded tests shrink CHUNK_NUMEL (the forked ranks inherit it) to stay small and fast.
SMALL_CHUNK = 4096
CASES = [((1009, 31), "big.weight"), ((9001,), "vec"), ((7, 5), "small"), ((3, 1), "tiny")]


def reference(shape: tuple[int, ...], key: str, seed: int = 11, std: float = 0.5) -> torch.Tensor:
    t = torch.empty(shape)
    init_normal_(t, std, seed, key)
    return t


def test_init_normal_plain_tensor() -> None:
    a = reference((1009, 3001), "w")
    assert chunk_rows((1009, 3001)) < 1009 // 2  # several chunks, so chunking is exercised
    assert torch.equal(a, reference((1009, 3001), "w"))
    assert not torch.equal(a, reference((1009, 3001), "w2"))
    assert not torch.equal(a, reference((1009, 3001), "w", seed=12))
    assert abs(a.std().item() - 0.5) < 0.005 and abs(a.mean().item()) < 0.005
    # Chunks are independent draws: rows of consecutive chunks are not repeats.
    r = chunk_rows((1009, 3001))
    assert not torch.equal(a[:r], a[r : 2 * r])
    # A bfloat16 parameter gets the fp32 values rounded.
    b = torch.empty(1009, 3001, dtype=torch.bfloat16)
    init_normal_(b, 0.5, 11, "w")
    assert torch.equal(b, a.to(torch.bfloat16))
    c = torch.empty(4, 4)
    init_constant_(c, 1.5)
    assert torch.equal(c, torch.full((4, 4), 1.5))
    assert CHUNK_NUMEL >= 2**16


# Ranks return numpy arrays: a torch tensor would travel as a shared-memory file descriptor
# that dies with the rank process before the parent unpickles it.


def _sharded_init(rank: int, world_size: int) -> dict[str, list[np.ndarray]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, list[np.ndarray]] = {}
    for shape, key in CASES:
        placements = [[Shard(0)], [Replicate()]]
        if len(shape) > 1:
            placements.append([Shard(1)])
        for pl in placements:
            d = distribute_tensor(torch.zeros(shape), mesh, pl)
            init_normal_(d, 0.5, 11, key)
            out.setdefault(key, []).append(d.full_tensor().numpy())
    # A 2-D mesh (1 x 2) with Shard(0) on the second axis and Replicate on the first.
    mesh2 = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("rep", "shard"))
    d = distribute_tensor(torch.zeros(1009, 31), mesh2, [Replicate(), Shard(0)])
    init_normal_(d, 0.5, 11, "big.weight")
    out["big.weight"].append(d.full_tensor().numpy())
    return out


def test_dtensor_layouts_match_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(init_mod, "CHUNK_NUMEL", SMALL_CHUNK)
    assert chunk_rows((1009, 31)) < 505 and 505 % chunk_rows((1009, 31))  # boundary mid-chunk
    assert chunk_rows((9001,)) < 4501 and 4501 % chunk_rows((9001,))
    results = run_distributed(_sharded_init, 2)
    for shape, key in CASES:
        ref = reference(shape, key)
        for rank_result in results:
            for full in rank_result[key]:
                assert torch.equal(torch.from_numpy(full), ref), key


TABLE_ROWS = {1: 1009, 3: 997}


def _engram_cfg() -> EngramConfig:
    return EngramConfig(
        layer_ids=[1, 3], n_head_per_ngram=4, vocab_size_per_ngram=[50, 60], n_embed_per_ngram=32
    )


def _fsdp_init(rank: int, world_size: int) -> dict[str, np.ndarray]:
    """FSDP2 over every layer + root, Engram tables row-sharded DTensors outside FSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = build_model(ModelConfig(name="qwen2"), _engram_cfg(), 300, TABLE_ROWS, device="meta")
    tables = []
    for block in model.engram_blocks().values():
        rows, dim = block.table.weight.shape
        sharded = distribute_tensor(torch.zeros(rows, dim), mesh, [Shard(0)])
        block.table.weight = nn.Parameter(sharded)
        tables.append(block.table.weight)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, ignored_params=set(tables))
    fully_shard(model, mesh=mesh, ignored_params=set(tables))
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    full = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        full[name] = p.detach().full_tensor().numpy()
    return full


def test_fsdp_and_sharded_tables_match_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(init_mod, "CHUNK_NUMEL", SMALL_CHUNK)  # tables span several chunks
    ref_model = build_model(
        ModelConfig(name="qwen2"), _engram_cfg(), 300, TABLE_ROWS, device="meta"
    )
    ref_model.to_empty(device="cpu")
    ref_model.init_weights(seed=5)
    ref = dict(ref_model.named_parameters())
    results = run_distributed(_fsdp_init, 2)
    for full in results:
        assert full.keys() == ref.keys()
        for name, value in full.items():
            assert torch.equal(torch.from_numpy(value), ref[name].detach()), name
