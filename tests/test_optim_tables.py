"""Engram table optimizers on one process: row-sparse gradients, lazy_adam == torch SparseAdam,
rowwise_adagrad against its formula, clipping equal to the dense path, no dense table gradient."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from launcher import run_isolated
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engram.config import ConfigError, Optimizer, config_from_dict
from engram.config.table_optimizers import TABLE_OPTIMIZERS
from engram.models.engram import EngramTable
from engram.models.table_grad import row_grad
from engram.optim.builder import build_table_optimizer, clip_grad_norm_
from engram.optim.lazy_adam import LazyAdam, RowwiseAdagrad

ROWS, DIM = 301, 8


def _table(seed: int = 0, rows: int = ROWS, row_sparse: bool = False) -> EngramTable:
    t = EngramTable(rows, DIM, row_sparse=row_sparse)
    with torch.no_grad():
        t.weight.copy_(torch.randn(rows, DIM, generator=torch.Generator().manual_seed(seed)))
    return t


def _batches(steps: int, micro: int = 1, rows: int = ROWS):
    """Per step, `micro` (ids, target) micro-batches; ids repeat rows within and across them."""
    gen = torch.Generator().manual_seed(7)
    return [
        [
            (
                torch.randint(0, rows // 3, (4, 6, 3), generator=gen),
                torch.randn(4, 6, 3, DIM, generator=gen),
            )
            for _ in range(micro)
        ]
        for _ in range(steps)
    ]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.tanh() * target).sum() / 7.0  # non-linear in the rows, duplicates included


def test_row_sparse_backward_leaves_no_dense_grad_and_sums_duplicates():
    dense, sparse = _table(), _table(row_sparse=True)
    ((ids, target),) = _batches(1)[0]
    _loss(dense(ids), target).backward()
    _loss(sparse(ids), target).backward()
    assert sparse.weight.grad is None
    rows, values = row_grad(sparse.weight)
    assert values.dtype == torch.float32
    assert torch.equal(rows, torch.unique(ids))  # unique, sorted, exactly the touched rows
    touched = dense.weight.grad.ne(0).any(1).nonzero().squeeze(1)
    assert set(touched.tolist()) <= set(rows.tolist())
    torch.testing.assert_close(values, dense.weight.grad[rows], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("micro", [1, 3])
def test_lazy_adam_equals_torch_sparse_adam(micro):
    """Same gradients (grad accumulation over `micro` micro-batches included) -> same weights and
    moments as torch.optim.SparseAdam on nn.Embedding(sparse=True)."""
    ours = _table(row_sparse=True)
    ref = nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(ours.weight)
    opt = LazyAdam(ours.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-6)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-6)
    for step in _batches(6, micro):
        for ids, target in step:
            _loss(ours(ids), target).backward()
            _loss(ref(ids), target).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert ours.weight.grad is None and row_grad(ours.weight) is None
    torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-6, atol=1e-7)
    # Micro-batches: torch sums the uncoalesced sparse grads in another order (fp32 noise).
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(
            opt.state[ours.weight][key], ref_opt.state[ref.weight][key], rtol=1e-5, atol=1e-7
        )
    assert opt.state[ours.weight]["step"].item() == ref_opt.state[ref.weight]["step"] == 6
    assert not torch.equal(ours.weight, _table().weight)


def test_rowwise_adagrad_matches_its_formula():
    ours = _table(row_sparse=True)
    w = ours.weight.detach().clone()
    acc = torch.zeros(ROWS)
    opt = RowwiseAdagrad(ours.parameters(), lr=0.1, eps=1e-6)
    assert opt.param_groups[0]["lr"] == 0.1
    for step in _batches(4, micro=2):
        ref = nn.Parameter(w.clone())
        for ids, target in step:
            _loss(ours(ids), target).backward()
            _loss(nn.functional.embedding(ids, ref), target).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for r in ref.grad.ne(0).any(1).nonzero().squeeze(1).tolist():
                g = ref.grad[r]
                acc[r] += g.pow(2).mean()
                w[r] -= 0.1 * g / (acc[r].sqrt() + 1e-6)
    torch.testing.assert_close(ours.weight.detach(), w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[ours.weight]["sum"], acc, rtol=1e-5, atol=1e-8)
    assert opt.state[ours.weight]["sum"].shape == (ROWS,)  # one state value per row


class _Model(nn.Module):
    def __init__(self, row_sparse: bool = False) -> None:
        super().__init__()
        self.tables = nn.ModuleList(
            [_table(1, row_sparse=row_sparse), _table(2, row_sparse=row_sparse)]
        )
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = sum(t(ids) for t in self.tables)
        return _loss(self.proj(out), target)


@pytest.mark.parametrize("name", ["lazy_adam", "rowwise_adagrad"])
def test_clip_norm_equals_dense_path(name):
    dense, sparse = _Model(), _Model(row_sparse=True)
    sparse.load_state_dict(dense.state_dict())
    build_table_optimizer(
        name,
        [{"params": [t.weight for t in sparse.tables], "lr": 1e-2, "weight_decay": 0.0}],
        (0.9, 0.95),
        1e-8,
    )
    for ids, target in _batches(1, micro=2)[0]:  # accumulated over two micro-batches
        dense(ids, target).backward()
        sparse(ids, target).backward()
    max_norm = 0.5
    want = clip_grad_norm_(dense.parameters(), max_norm)
    got = clip_grad_norm_(sparse.parameters(), max_norm)
    assert want > max_norm  # the clip really scales
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for td, ts in zip(dense.tables, sparse.tables, strict=True):
        assert ts.weight.grad is None
        rows, values = row_grad(ts.weight)
        torch.testing.assert_close(values, td.weight.grad[rows], rtol=1e-5, atol=1e-8)
        other = torch.ones(ROWS, dtype=torch.bool)
        other[rows] = False
        assert not td.weight.grad[other].any()  # every non-zero row is in the row set
    torch.testing.assert_close(sparse.proj.weight.grad, dense.proj.weight.grad)


class _LargestAllocation(TorchDispatchMode):
    """Bytes of the largest NEW storage any op produces (autograd's grad buffers included); in-place
    ops and views, whose output shares an input's storage, allocate nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [*args, *(kwargs or {}).values()]
        seen = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _step_allocation(name: str) -> tuple[int, int, torch.Tensor | None]:
    rows = 20_000
    table = _table(rows=rows, row_sparse=TABLE_OPTIMIZERS[name].row_sparse)
    opt = build_table_optimizer(
        name, [{"params": [table.weight], "lr": 1e-2, "weight_decay": 0.0}], (0.9, 0.95), 1e-8
    )
    batches = _batches(2, rows=rows)
    ids, target = batches[0][0]
    _loss(table(ids), target).backward()
    opt.step()  # the first step allocates the optimizer state (table-sized for Adam moments)
    opt.zero_grad()
    ids, target = batches[1][0]
    with _LargestAllocation() as mode:
        _loss(table(ids), target).backward()
        grad = table.weight.grad
        opt.step()
    opt.zero_grad()
    return mode.largest, table.weight.numel() * table.weight.element_size(), grad


@pytest.mark.parametrize("name", ["lazy_adam", "rowwise_adagrad"])
def test_row_sparse_optimizer_allocates_no_dense_table_gradient(name):
    largest, table_bytes, grad = _step_allocation(name)
    assert grad is None
    assert largest < table_bytes / 20, (largest, table_bytes)
    # The measurement sees a table-sized gradient where there is one (the dense path).
    largest, table_bytes, grad = _step_allocation("adam")
    assert grad is not None and largest >= table_bytes


def test_config_table_optimizer_and_deprecated_alias():
    assert Optimizer().table_optimizer == "adam"
    with pytest.warns(DeprecationWarning, match="table_optimizer"):
        o = Optimizer(table_lazy=True)
    assert (o.table_optimizer, o.table_lazy) == ("lazy_adam", False)
    with pytest.raises(ConfigError, match="contradicts"):
        Optimizer(table_lazy=True, table_optimizer="rowwise_adagrad")
    with pytest.raises(ConfigError, match="lazy_adam"):
        Optimizer(table_optimizer="sparse_adam")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = config_from_dict({"optimizer": {"table_optimizer": "rowwise_adagrad"}})
    assert cfg.optimizer.table_optimizer == "rowwise_adagrad"


def test_row_sparse_optimizers_reject_non_tables():
    for cls in (LazyAdam, RowwiseAdagrad):
        with pytest.raises(ValueError, match="2-D"):
            cls([nn.Parameter(torch.zeros(3))])


@pytest.mark.parametrize("name", ["lazy_adam", "rowwise_adagrad"])
def test_untouched_rows_and_their_state_stay_unchanged(name):
    table = _table(row_sparse=True)
    before = table.weight.detach().clone()
    opt = build_table_optimizer(
        name, [{"params": [table.weight], "lr": 1e-2, "weight_decay": 0.1}], (0.9, 0.95), 1e-8
    )
    touched = torch.zeros(ROWS, dtype=torch.bool)
    for step in _batches(3):
        for ids, target in step:
            touched[ids.reshape(-1)] = True
            _loss(table(ids), target).backward()
        opt.step()
        opt.zero_grad()
    w = table.weight.detach()
    assert torch.equal(w[~touched], before[~touched])  # no decay, no moment-driven drift
    assert not torch.equal(w[touched], before[touched])
    for value in opt.state[table.weight].values():
        if value.dim() > 0:
            assert not value[~touched].any()


@pytest.mark.parametrize("name", ["lazy_adam", "rowwise_adagrad"])
def test_state_dict_round_trip_continues_identically(name):
    def run(steps, start=None):
        table = _table(row_sparse=True)
        opt = build_table_optimizer(
            name, [{"params": [table.weight], "lr": 1e-2, "weight_decay": 0.0}], (0.9, 0.95), 1e-8
        )
        if start is not None:
            table.load_state_dict(start[0])
            opt.load_state_dict(copy.deepcopy(start[1]))
        for step in steps:
            for ids, target in step:
                _loss(table(ids), target).backward()
            opt.step()
            opt.zero_grad()
        return table.state_dict(), opt.state_dict()

    batches = _batches(5)
    full = run(batches)
    resumed = run(batches[3:], start=run(batches[:3]))
    assert torch.equal(full[0]["weight"], resumed[0]["weight"])


def _lookups_row_sparse_after_parallelize(cfg) -> bool:
    """parallelize_model on one fake rank: are the Engram tables' lookups row-sparse?"""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from engram.data.tokenizer import load_tokenizer
    from engram.models.builder import build_from_config
    from parallelisms.parallel_dims import parallel_dims_from_config
    from parallelisms.parallelize import parallelize_model

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        dims = parallel_dims_from_config(cfg, 1)
        dims.build_mesh("cpu")
        model, _ = build_from_config(cfg, load_tokenizer(""))
        parallelize_model(model, cfg, dims)
        return all(b.table.lookup.row_sparse for b in model.engram_blocks().values())
    finally:
        dist.destroy_process_group()


def test_table_optimizer_spec_is_read_by_config_builder_lookup_pipeline_and_planner(monkeypatch):
    """A table optimizer added to engram/config/table_optimizers.py alone is accepted by the config,
    built by the optimizer builder, makes parallelize_model's lookups row-sparse, is refused by
    the split-backward pipeline schedules and sized by the planner from its state per row."""
    from engram.config.table_optimizers import TableOptimizerSpec, table_memory_bytes
    from engram.data.tokenizer import load_tokenizer
    from engram.models.builder import build_from_config
    from parallelisms.pipeline import split_stages

    spec = TableOptimizerSpec(
        "rows_only", "engram.optim.lazy_adam:RowwiseAdagrad", True, 0, 3, False
    )
    monkeypatch.setitem(TABLE_OPTIMIZERS, "rows_only", spec)
    cfg = config_from_dict({"optimizer": {"table_optimizer": "rows_only"}})
    table = _table(row_sparse=True)
    opt = build_table_optimizer(
        "rows_only", [{"params": [table.weight], "lr": 1e-2, "weight_decay": 0.0}], (0.9, 0.9), 1e-8
    )
    assert type(opt) is RowwiseAdagrad
    assert table_memory_bytes("rows_only", 10, 4) == {"weight": 160, "grad": 0, "optimizer": 120}
    model, _ = build_from_config(cfg, load_tokenizer(""))
    with pytest.raises(ConfigError, match="rows_only"):
        pp_cfg = config_from_dict(
            {
                "parallelism": {"pp": 2},
                "pipeline": {"schedule": "ZBVZeroBubble", "virtual_stages": 2},
                "optimizer": {"table_optimizer": "rows_only"},
            }
        )
        split_stages(model, pp_cfg, dims=None)
    assert run_isolated(_lookups_row_sparse_after_parallelize, cfg)
    with pytest.raises(ConfigError, match="table_optimizer"):
        config_from_dict({"optimizer": {"table_optimizer": "not_registered"}})


def _norm_groups_by_placement() -> dict[str, object]:
    """On one fake rank of a 2 x 2 mesh: the groups the dense norm path (clip_grad_norm_) and
    the row-sparse one (row_grad_norm_sq) sum a tensor over, per placement."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from engram.models.table_grad import accumulate_row_grad, row_grad_norm_sq
    from engram.runtime.distributed import shard_groups

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        groups = {name: mesh.get_group(name) for name in ("a", "b")}
        names = {g: name for name, g in groups.items()}
        cases = {
            "plain": None,
            "shard_replicate": (Shard(0), Replicate()),
            "replicate_strided": (Replicate(), _StridedShard(0, split_factor=2)),
            "shard_shard": (Shard(0), Shard(1)),
        }
        got = {}
        for case, placements in cases.items():
            t = torch.zeros(4, 2)
            if placements is not None:
                t = DTensor.from_local(t, mesh, placements, run_check=False)
            accumulate_row_grad(t, torch.tensor([0, 1]), torch.ones(2, 2))
            (row_key,) = row_grad_norm_sq([t])
            got[case] = ([names[g] for g in shard_groups(t)], [names[g] for g in row_key])
        partial = DTensor.from_local(torch.zeros(4, 2), mesh, (Partial(), Replicate()))
        try:
            shard_groups(partial)
        except ValueError as e:
            got["partial"] = str(e)
        return got
    finally:
        dist.destroy_process_group()


def test_dense_and_row_sparse_norms_sum_over_the_same_groups():
    """One rule (engram.runtime.distributed.shard_groups) gives the groups of both gradient-norm
    paths: Shard and FSDP's _StridedShard dims are summed over, Replicate dims counted once, a
    pending Partial refused."""
    got = run_isolated(_norm_groups_by_placement)
    assert got.pop("partial").startswith("cannot take the norm of a tensor with placements")
    assert got == {
        "plain": ([], []),
        "shard_replicate": (["a"], ["a"]),
        "replicate_strided": (["b"], ["b"]),
        "shard_shard": (["a", "b"], ["a", "b"]),
    }
