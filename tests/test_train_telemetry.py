"""Engram and tier telemetry pieces (engram/models/engram_stats.py, engram/optim/update_stats.py,
engram/train/telemetry.py) and the start-up rules they share with the planner
(engram/rowstore/tier_rules.py, engram/checkpoint/capacity.py, engram/runtime/filesystems.py),
each against a computation by hand. Whole runs: tests/test_parallelisms_parity.py (every
data-parallel layout logs the single process's Engram telemetry),
tests/test_parallelisms_nvme_tables.py (NVMe page counters = the stores' own counts),
tests/test_runner_start_checks.py (refusals at start)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engram.checkpoint.capacity import async_save_host_problem, kept_checkpoint_bytes
from engram.config import Engram as EngramConfig
from engram.models import engram_stats
from engram.models.engram import EngramBlock
from engram.models.engram_stats import FIELDS, EngramStats
from engram.optim.lazy_adam import LazyAdam, RowwiseAdagrad
from engram.optim.update_stats import TableUpdateStats, dense_adam_update, mark_dense_touched
from engram.rowstore.tier_rules import endurance_warning, page_space_problem, probe_warning
from engram.runtime import filesystems

torch.set_num_threads(2)
LAYER = 3


def _block(hc_mult: int = 1) -> EngramBlock:
    cfg = EngramConfig(layer_ids=[LAYER], max_ngram=3, n_head_per_ngram=4,
                       vocab_size_per_ngram=[50, 60], n_embed_per_ngram=32, hc_mult=hc_mult,
                       init="paper")  # fmt: skip
    block = EngramBlock(16, cfg, table_rows=400, layer_id=LAYER)
    block.init_weights(seed=1, prefix="layers.3.engram")
    return block


def _inputs(hc_mult: int = 1):
    gen = torch.Generator().manual_seed(0)
    shape = (2, 12, 16) if hc_mult == 1 else (2, 12, hc_mult, 16)
    hidden = torch.randn(shape, generator=gen, requires_grad=True)
    return hidden, torch.randint(0, 400, (2, 12, 8), generator=gen)


def _gates_by_hand(block: EngramBlock, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The block's gates, computed here from its modules ([B, T, hc])."""
    e = F.embedding(ids, block.table.weight).flatten(-2)
    h = hidden if hidden.dim() == 4 else hidden.unsqueeze(2)
    gates = []
    for m in range(block.hc_mult):
        key = block.key_norms[m](block.key_projs[m](e))
        dot = (key * block.query_norms[m](h[:, :, m])).sum(-1) / math.sqrt(block.dim)
        gates.append(torch.sigmoid(dot.sign() * dot.abs().clamp_min(1e-6).sqrt()))
    return torch.stack(gates, dim=2)


@pytest.mark.parametrize("hc_mult", [1, 2])
def test_engram_stats_against_a_computation_by_hand(hc_mult):
    block = _block(hc_mult)
    hidden, ids = _inputs(hc_mult)
    plain = block(hidden, ids)
    stats = EngramStats([0, LAYER], torch.device("cpu"))
    with engram_stats.recording(stats):
        out = block(hidden, ids)
    assert torch.equal(out, plain)  # the side channel changes nothing
    assert engram_stats.sink() is None  # closed again
    g = _gates_by_hand(block, hidden, ids).detach()
    p = g.clamp(1e-6, 1 - 1e-6)
    want = {
        "gate_sum": g.sum(), "gate_high": (g > 0.5).sum(),
        "gate_entropy": -(p * p.log() + (1 - p) * (1 - p).log()).sum(),
        "positions": g.numel(), "out_sq": plain.detach().pow(2).sum(),
        "residual_sq": hidden.detach().pow(2).sum(),
    }  # fmt: skip
    got = dict(zip(FIELDS, stats.sums[1].tolist(), strict=True))
    assert stats.sums[0].eq(0).all()  # another layer's row
    for k, v in want.items():
        assert got[k] == pytest.approx(float(v), rel=1e-5), k


def test_activation_checkpoint_recompute_is_not_counted_twice():
    block = _block()
    hidden, ids = _inputs()
    once, twice = (EngramStats([LAYER], torch.device("cpu")) for _ in range(2))
    with engram_stats.recording(once):
        block(hidden, ids).sum().backward()
    with engram_stats.recording(twice):
        out = torch.utils.checkpoint.checkpoint(block, hidden, ids, use_reentrant=False)
        out.sum().backward()  # the recompute runs the forward again, inside backward
    assert torch.equal(once.sums, twice.sums)


def test_compiled_block_no_graph_break_off_log_steps_and_same_stats_on():
    block = _block()
    hidden, ids = _inputs()
    explain = torch._dynamo.explain(block)(hidden, ids)
    assert explain.graph_break_count == 0, explain.break_reasons  # no collector open
    eager, compiled = (EngramStats([LAYER], torch.device("cpu")) for _ in range(2))
    with engram_stats.recording(eager):
        want = block(hidden, ids)
    torch._dynamo.reset()
    fn = torch.compile(block, backend="eager")
    assert torch.equal(fn(hidden, ids), want)  # off: compiled, no collector
    with engram_stats.recording(compiled):
        assert torch.equal(fn(hidden, ids), want)
    torch.testing.assert_close(compiled.sums, eager.sums)


def _table_with_row_grad(opt_cls):
    from engram.models.table_grad import accumulate_row_grad

    gen = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter(torch.randn(50, 8, generator=gen))
    rows = torch.tensor([3, 7, 11, 40])
    opt = opt_cls([w], lr=0.1)
    for _ in range(2):  # the second step moves the moments too
        accumulate_row_grad(w, rows, torch.randn(4, 8, generator=gen))
        before = w.detach().clone()
        stats = opt.update_stats = TableUpdateStats()
        opt.step()
        opt.update_stats = None
        opt.zero_grad()
    return w, before, rows, stats


@pytest.mark.parametrize("opt_cls", [LazyAdam, RowwiseAdagrad])
def test_row_sparse_update_stats_against_the_weights(opt_cls):
    w, before, rows, stats = _table_with_row_grad(opt_cls)
    touched, sq, n = stats.values(w, torch.device("cpu")).tolist()
    diff = (w.detach() - before)[rows]
    assert touched == 4 and n == diff.numel()
    assert math.sqrt(sq / n) == pytest.approx(diff.pow(2).mean().sqrt().item(), rel=1e-5)
    assert (w.detach() - before).abs().sum(1).ne(0).sum() == 4  # only those rows moved


def test_dense_adam_update_stats_against_the_weights():
    gen = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(300, 8, generator=gen))
    opt = torch.optim.AdamW([w], lr=0.05, weight_decay=0.0)
    for _ in range(3):
        w.grad = torch.zeros_like(w)
        rows = torch.randperm(300, generator=gen)[:40]
        w.grad[rows] = torch.randn(40, 8, generator=gen)
        before = w.detach().clone()
        stats = TableUpdateStats()
        mark_dense_touched(stats, w)
        opt.step()
        dense_adam_update(stats, opt, w)
    touched, sq, n = stats.values(w, torch.device("cpu")).tolist()
    diff = (w.detach() - before)[rows]  # dense Adam also moves untouched rows: not counted
    assert touched == 40 and n == 40 * 8
    assert math.sqrt(sq / n) == pytest.approx(diff.pow(2).mean().sqrt().item(), rel=1e-4)


def test_kept_checkpoint_bytes_by_hand():
    # full saves only: keep 3 + the one being committed
    assert kept_checkpoint_bytes(100, 10, 3, 1, 10) == 4 * 100
    assert kept_checkpoint_bytes(100, 10, 3, 1, 2) == 2 * 100  # a run of two saves
    assert kept_checkpoint_bytes(100, 10, 0, 1, 5) == 5 * 100  # keep all
    # full every 10: at the 11th save (a base) the kept 8-10 deltas still need the first base
    assert kept_checkpoint_bytes(100, 10, 3, 10, 100) == 100 + 3 * 10 + 100
    # full every 3, keep 1: the new base + the kept delta + its base
    assert kept_checkpoint_bytes(100, 10, 1, 3, 20) == 100 + 10 + 100
    assert kept_checkpoint_bytes(100, 10, 0, 4, 9) == 3 * 100 + 6 * 10


def test_problems_and_warnings_name_both_numbers_and_the_fix():
    gib = 2**30
    assert page_space_problem(gib, 2 * gib, "per node", "the drives hold") is None
    p = page_space_problem(3 * gib, gib, "on /x", "it has free")
    assert p.startswith("NVMe capacity") and "3.00 GiB" in p and "1.00 GiB" in p
    assert async_save_host_problem(gib, gib, 4 * gib, "MemAvailable") is None
    a = async_save_host_problem(3 * gib, 2 * gib, 4 * gib, "MemAvailable")
    assert a.startswith("checkpoint host memory") and 'async_mode = "disabled"' in a
    assert endurance_warning(0.5, 1.0, "x") is None
    assert "2.50 drive writes per day" in endurance_warning(2.5, 1.0, "x")
    # 1000 reads/s, 40,000 pages of 4 KiB a step: 40 s > a 30 s step
    assert probe_warning(1000.0, 20_000, 4096, 30.0, "/d") is None
    w = probe_warning(1000.0, 40_000, 4096, 30.0, "/d")
    assert "1,000 random 4 KiB" in w and "40,000 page reads" in w and "40.00 s" in w


def test_storage_warning_for_memory_and_network_file_systems(tmp_path, monkeypatch):
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "tmpfs /dev/shm tmpfs rw 0 0\n"
        "server:/export /mnt/my\\040share nfs4 rw 0 0\n"
    )
    assert filesystems.mount_of("/mnt/my share/x/y", str(mounts)).fstype == "nfs4"
    assert filesystems.mount_of("/dev/shm/a", str(mounts)).point == "/dev/shm"
    real = filesystems.mount_of
    monkeypatch.setattr(filesystems, "mount_of", lambda p: real(p, str(mounts)))
    assert "tmpfs" in filesystems.storage_warning("/dev/shm/pages")
    assert "network file system nfs4" in filesystems.storage_warning("/mnt/my share/pages")
    assert filesystems.storage_warning("/var/pages") is None
