"""LazyRowAdam: exact Adam/AdamW when every row is touched, untouched rows frozen, per-row reference."""

from __future__ import annotations

import copy

import pytest
import torch

from engram.lazy_adam import LazyRowAdam
from tests.launcher import run_distributed


def _grads(shape: tuple[int, int], steps: int, touched: list[list[int]] | None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        g = torch.randn(shape, generator=gen)
        if touched is not None:
            mask = torch.zeros(shape[0], dtype=torch.bool)
            mask[touched[s]] = True
            g[~mask] = 0
        out.append(g)
    return out


def _run(opt_cls, weight: torch.Tensor, grads: list[torch.Tensor], **kw):
    p = torch.nn.Parameter(weight.clone())
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


def _reference(weight, grads, lr, betas, eps, wd):
    """Naive per-row loop: the row's moments and weight change only on steps that touch it."""
    w = weight.clone().double()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for step, g in enumerate(grads, start=1):
        g = g.double()
        for r in range(w.shape[0]):
            if not bool(g[r].ne(0).any()):
                continue
            w[r] *= 1 - lr * wd
            m[r] = betas[0] * m[r] + (1 - betas[0]) * g[r]
            v[r] = betas[1] * v[r] + (1 - betas[1]) * g[r] ** 2
            m_hat = m[r] / (1 - betas[0] ** step)
            v_hat = v[r] / (1 - betas[1] ** step)
            w[r] -= lr * m_hat / (v_hat.sqrt() + eps)
    return w, m, v


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_equals_adam_when_all_rows_touched(wd):
    weight = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    grads = _grads((7, 5), 4, None)
    kw = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": wd}
    got, _ = _run(LazyRowAdam, weight, grads, **kw)
    ref_cls = torch.optim.AdamW if wd else torch.optim.Adam
    want, _ = _run(ref_cls, weight, grads, foreach=False, **kw)
    assert torch.equal(got, want)


def test_untouched_rows_frozen_and_matches_row_reference():
    weight = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    touched = [[0, 2], [2, 3], [0, 5, 2], [3]]
    grads = _grads((6, 4), 4, touched, seed=3)
    kw = {"lr": 5e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
    got, opt = _run(LazyRowAdam, weight, grads, **kw)
    state = opt.state[opt.param_groups[0]["params"][0]]
    # row 1 is never touched: weight and moments exactly unchanged
    assert torch.equal(got[1], weight[1])
    assert torch.equal(state["exp_avg"][1], torch.zeros(4))
    assert torch.equal(state["exp_avg_sq"][1], torch.zeros(4))
    assert state["step"].item() == 4
    w_ref, m_ref, v_ref = _reference(weight, grads, kw["lr"], kw["betas"], kw["eps"], 0.05)
    torch.testing.assert_close(got.double(), w_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state["exp_avg"].double(), m_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state["exp_avg_sq"].double(), v_ref, rtol=1e-6, atol=1e-9)
    # plain Adam would have moved the untouched row 1 via weight decay / moved moments: differs
    adam, _ = _run(torch.optim.AdamW, weight, grads, foreach=False, **kw)
    assert not torch.equal(adam, got)


def test_state_dict_round_trip_continues_identically():
    weight = torch.randn(5, 3, generator=torch.Generator().manual_seed(4))
    touched = [[0, 1], [1, 4], [2], [0, 4]]
    grads = _grads((5, 3), 4, touched, seed=5)
    full, _ = _run(LazyRowAdam, weight, grads, lr=1e-2)
    half, opt = _run(LazyRowAdam, weight, grads[:2], lr=1e-2)
    p2 = torch.nn.Parameter(half.clone())
    opt2 = LazyRowAdam([p2], lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for g in grads[2:]:
        p2.grad = g.clone()
        opt2.step()
    assert torch.equal(p2.detach(), full)


def test_rejects_non_2d_params():
    with pytest.raises(ValueError, match="2-D"):
        LazyRowAdam([torch.nn.Parameter(torch.zeros(3))])


def _dtensor_worker(rank: int, world: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    weight = torch.randn(11, 4, generator=torch.Generator().manual_seed(6))
    grads = _grads((11, 4), 3, [[0, 10], [5, 6, 10], [1]], seed=7)
    want, _ = _run(LazyRowAdam, weight, grads, lr=1e-2, weight_decay=0.1)
    p = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
    opt = LazyRowAdam([p], lr=1e-2, weight_decay=0.1)
    for g in grads:
        p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        opt.step()
    state = opt.state[p]
    assert state["exp_avg"].placements == (Shard(0),)
    return torch.equal(p.full_tensor(), want)


def test_dtensor_params_match_plain_tensor():
    assert all(run_distributed(_dtensor_worker, 2))
