"""The planner's NVMe tier and table checkpoint terms (planner/nvme.py,
planner/table_checkpoint.py) against counts by hand, a refusal for each limit, and the shipped
~1T-table configs planned at 64 ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from launcher import run_isolated

from engram.config import config_from_dict, load_config
from engram.hashing.ngram import engram_table_rows
from engram.runtime.device_specs import usable_memory_gib
from planner.estimate import estimate
from planner.nvme import nvme_tier, page_file_bytes, record_bytes
from planner.registry import check_modelled
from planner.results import GIB, RankMemory
from planner.table_checkpoint import cadence_rows, table_checkpoint, table_checkpoint_problems
from planner.tier_results import TierAssumptions

# Small hardware so the numbers are easy to count: 2 drives of 1 TB per node.
HW = TierAssumptions(
    nvme_drives_per_node=2,
    nvme_tb_per_drive=1.0,
    nvme_read_kiops=100.0,
    nvme_write_kiops=50.0,
    nvme_read_gbs=1.0,
    nvme_write_gbs=0.5,
    step_time_s=10.0,
    unique_rows_per_step=10_000,
    reuse_last_step=0.5,
    reuse_window=0.75,
    checkpoint_write_gbs=2.0,
)
ROWS = 1_000_003  # local rows of each of the rank's two tables


def _cfg(optimizer: str = "lazy_adam", cache_gib: float = 1.0):
    # head_dim = 512 / 8 = 64; 2 orders x 8 heads = 16 hash heads per layer.
    return config_from_dict(
        {
            "engram": {
                "layer_ids": [2, 5],
                "n_embed_per_ngram": 512,
                "n_head_per_ngram": 8,
                "max_ngram": 3,
                "table_location": "nvme",
                "nvme_dirs": ["/tmp/a", "/tmp/b"],
                "nvme_host_cache_gib": cache_gib,
            },
            "training": {"local_batch_size": 2, "seq_len": 1024, "grad_accum_steps": 1},
            "optimizer": {"table_optimizer": optimizer},
            "checkpoint": {"interval": 100},
        }
    )


def _rank() -> RankMemory:
    return RankMemory(
        rank=0,
        dense_params=0,
        dense_param_bytes=0,
        table_rows={2: ROWS, 5: ROWS},
        table_params=2 * ROWS * 64,
        table_param_bytes=2 * ROWS * 64 * 4,
        grad_bytes=0,
        optimizer_bytes=0,
        buffer_bytes=0,
        optimizer_step_temp_bytes=0,
        host_bytes=0,
    )


def _tier(cfg=None, host_bytes: int = 0, hw: TierAssumptions = HW):
    # 4 ranks per node
    return nvme_tier(cfg or _cfg(), _rank(), 4, host_bytes, hw)


def test_records_and_pages_as_the_store_packs_them():
    # lazy_adam: weight + 2 moments = 3 x 64 fp32 = 768 B; 4096 // 768 = 5 records per page.
    assert record_bytes("lazy_adam", 64) == 768
    assert page_file_bytes(ROWS, 768) == 200_001 * 4096  # ceil(1,000,003 / 5) pages
    # rowwise_adagrad: weight + 1 sum = 65 fp32 = 260 B; 4096 // 260 = 15 per page.
    assert record_bytes("rowwise_adagrad", 64) == 260
    assert page_file_bytes(ROWS, 260) == 66_667 * 4096  # ceil(1,000,003 / 15)
    # above 4 KiB: one record per page of the next multiple of 4 KiB
    assert page_file_bytes(3, 4100) == 3 * 8192


def test_nvme_terms_against_counts_by_hand():
    t = _tier(host_bytes=64 * GIB)
    # capacity: 4 ranks x 2 tables x 200,001 pages x 4096 B, of 2 x 1 TB
    assert t.drive_bytes_needed == 4 * 2 * 200_001 * 4096 == 6_553_632_768
    assert t.drive_bytes == 2 * 10**12
    # host per node: 4 x (1 GiB cache + 2 tables x 64 MiB staging + 2 x 200,001 pages x 10 B
    # of page index)
    assert t.host_bytes_needed == 4 * (GIB + 2 * 64 * 2**20 + 2 * 200_001 * 10) == 4_847_838_288
    # step rows: 2 x 1024 tokens per rank x 16 heads / (tp 1 x cp 1) = 32,768 ids >= 10,000
    assert t.step_rows_per_table == 10_000
    # the 1 GiB cache gives each table 512 MiB >= 2 steps x 10,000 pages x 4 KiB: reuse counts.
    # reads: 4 ranks x 2 tables x 10,000 x (1 - 0.5) = 40,000 pages per node, as many writes
    assert t.pages_read_per_step == t.pages_written_per_step == 40_000
    # reads: max(40,000 / (2 x 100k IOPS) = 0.2 s, 40,000 x 4096 / 2 GB/s = 0.08 s) = 0.2 s
    # writes: max(40,000 / (2 x 50k) = 0.4 s, 163.84 MB / 1 GB/s = 0.164 s) = 0.4 s
    assert t.io_seconds_per_step == pytest.approx(0.6)
    # endurance: 163,840,000 B per step x 8,640 steps a day / 2e12 B of drives
    assert t.drive_writes_per_day == pytest.approx(40_000 * 4096 * 8_640 / 2e12)
    assert t.drive_writes_per_day == pytest.approx(0.7077888)
    assert t.problems == []


def test_reuse_needs_two_steps_of_cache():
    # 0.1 GiB cache: 53.7 MB per table < 2 x 10,000 x 4 KiB = 81.9 MB: no reuse counted, every
    # step row is read: 4 x 2 x 10,000 = 80,000 pages per node
    t = _tier(_cfg(cache_gib=0.1))
    assert t.pages_read_per_step == 80_000


def test_table_checkpoint_against_counts_by_hand():
    c = table_checkpoint(_cfg(), _rank(), 4, 0, HW)
    # full: 4 ranks x 2 x 1,000,003 rows x 768 B
    assert c.full_bytes == 4 * 2 * ROWS * 768 == 6_144_018_432
    # touched over 100 steps: 10,000 x (1 + 99 x (1 - 0.75)) = 257,500 rows per table and rank
    assert c.touched_rows_per_table == 257_500
    # incremental: 4 x 2 x 257,500 x (768 B + 8 B row id)
    assert c.incremental_bytes == 8 * 257_500 * 776 == 1_598_560_000
    assert c.full_seconds == pytest.approx(6_144_018_432 / 2e9)
    assert c.incremental_seconds == pytest.approx(0.79928)
    # a long interval touches at most the shard
    long = dataclasses.replace(
        _cfg(), checkpoint=dataclasses.replace(_cfg().checkpoint, interval=10**6)
    )
    assert table_checkpoint(long, _rank(), 4, 0, HW).touched_rows_per_table == ROWS


def test_full_save_host_memory_against_counts_by_hand():
    """A synchronous save streams one 64 MiB chunk per rank; an asynchronous one reads every
    shard column whole, refused by name where that does not fit next to the NVMe tier (whose
    host memory counts the async staging copy)."""
    c = table_checkpoint(_cfg(), _rank(), 4, 10 * 10**9, HW)
    assert c.streams and c.save_host_bytes == 4 * 64 * 2**20 == 268_435_456
    assert table_checkpoint_problems(c, 9 * 10**9) == []
    cfg = _cfg()
    cfg = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, async_mode="async")
    )
    a = table_checkpoint(cfg, _rank(), 4, 20 * 10**9, HW)
    # 4 ranks x 2 tables x 1,000,003 rows x 768 B
    assert not a.streams and a.save_host_bytes == 6_144_018_432
    assert table_checkpoint_problems(a, 13 * 10**9) == []  # 6.14 + 13 <= 20 GB
    (problem,) = table_checkpoint_problems(a, 14 * 10**9)  # 20.14 > 20 GB
    assert problem.startswith("checkpoint host memory") and 'async_mode = "disabled"' in problem


def test_rowwise_adagrad_pages():
    t = _tier(_cfg("rowwise_adagrad"))
    assert t.drive_bytes_needed == 4 * 2 * 66_667 * 4096


@pytest.mark.parametrize(
    "change, host_bytes, name",
    [
        ({"nvme_tb_per_drive": 0.001}, 0, "NVMe capacity"),  # 2 GB < 6.55 GB of page files
        ({}, 4 * 10**9, "host memory"),  # 4.0 GB < 4.83 GB per node
        ({"step_time_s": 0.5}, 0, "NVMe I/O"),  # 0.6 s of I/O > 0.5 s
    ],
)
def test_each_limit_is_refused_by_name(change, host_bytes, name):
    t = _tier(host_bytes=host_bytes, hw=dataclasses.replace(HW, **change))
    assert len(t.problems) == 1 and t.problems[0].startswith(name), t.problems


def test_a_cache_smaller_than_a_steps_pages_is_refused_by_name():
    # 0.05 GiB = 53.7 MB < 2 tables x 10,000 pinned pages x 4 KiB = 81.9 MB
    t = _tier(_cfg(cache_gib=0.05))
    assert [p.split(":")[0] for p in t.problems] == ["NVMe host cache"]
    assert "engram.nvme_host_cache_gib" in t.problems[0]


def test_estimate_plans_nvme_tables_end_to_end():
    """check_modelled accepts nvme; estimate() counts the debug config's page files from the
    table rows (NgramHasher sizes, torch.chunk split) and refuses what does not fit."""
    args = [
        "--job.config_file", "train_configs/debug_model.toml",
        "--engram.table_location=nvme", "--engram.nvme_dirs=[\"/tmp/x\"]",
        "--optimizer.table_optimizer=lazy_adam", "--engram.nvme_host_cache_gib=0.5",
    ]  # fmt: skip
    cfg = load_config(args)
    check_modelled(cfg)
    est = run_isolated(estimate, cfg, 2, [0, 1], ranks_per_node=2, host_memory_gib=64)
    rows = engram_table_rows(cfg.engram)  # layer -> rows
    record = 4 * 3 * cfg.engram.head_dim  # weight + 2 moments, 128 wide: 1536 B, 2 per page
    assert record == record_bytes("lazy_adam", cfg.engram.head_dim) == 1536
    worst = max(
        sum(torch.chunk(torch.empty(r, device="meta"), 2)[k].shape[0] for r in rows.values())
        for k in (0, 1)
    )
    assert est.nvme.drive_bytes_needed == 2 * (-(-worst // 2)) * 4096
    assert est.nvme.problems == [] and est.fits
    assert est.table_checkpoint.full_bytes == 2 * worst * record
    small = run_isolated(estimate, cfg, 2, [0, 1], ranks_per_node=2, host_memory_gib=0.5)
    assert not small.fits and small.nvme.problems[0].startswith("host memory")


@pytest.mark.parametrize(
    "path, location",
    [
        ("train_configs/32b_npu_1t_tables.toml", "nvme"),
        ("train_configs/32b_npu_1t_tables_adagrad.toml", "host"),
    ],
)
def test_1t_table_configs_plan_on_64_npus(path, location):
    """The ~1T-table presets: ~1T table parameters, fit at 64 ranks with >= 10% of usable NPU
    memory free and their host / NVMe assumptions, as their headers say."""
    cfg = load_config(["--job.config_file", path])
    assert cfg.engram.table_location == location
    est = run_isolated(estimate, cfg, 64, [0])
    assert 0.99e12 < est.global_table_params < 1.01e12
    usable = usable_memory_gib("npu") * GIB
    peak = max(m.peak_bytes for m in est.ranks)
    assert est.fits and usable - peak >= 0.10 * usable
    header = open(path).read().split("\n[job]")[0]
    assert f"peak {peak / GIB:.1f} GiB of {usable_memory_gib('npu'):g} usable" in header
    # incremental table checkpoints, at the cadence the planner's table justifies in the header
    every = cfg.checkpoint.table_full_every
    _, per_save, kept, _ = next(r for r in cadence_rows(est.table_checkpoint) if r[0] == every)
    assert every > 1 and f"{every}: {per_save:.0f} / {kept:.0f}" in header.replace("\n# ", " ")
    if location == "nvme":
        assert est.nvme.problems == []
        # a full save streams: 8 ranks x one 64 MiB chunk, not the 1396 GiB of tables per node
        assert est.table_checkpoint.streams
        assert est.table_checkpoint.save_host_bytes == 8 * 64 * 2**20
        assert est.table_checkpoint.full_bytes > est.host_memory_bytes
        assert f"{est.nvme.drive_bytes_needed / GIB:.0f} GiB per node" in header
    else:
        assert est.host_table_bytes_per_node <= 1024 * GIB
        assert f"{est.host_table_bytes_per_node / GIB:.1f} GiB of 1024" in header


def test_cli_flags_reach_the_plan(capfd):
    """The hardware flags are the plan's assumptions; an I/O refusal reaches the report."""
    from planner.cli import main

    argv = [
        "--world_size", "2", "--job.config_file", "train_configs/debug_model.toml",
        "--engram.table_location=nvme", "--engram.nvme_dirs=[\"/tmp/x\"]",
        "--optimizer.table_optimizer=lazy_adam", "--nvme_drives_per_node", "1",
        "--nvme_read_kiops", "0.001", "--step_time_s", "2",
    ]  # fmt: skip
    est = run_isolated(main, argv)
    assert est.nvme.assumptions.nvme_drives_per_node == 1
    assert est.nvme.assumptions.step_time_s == 2.0
    assert not est.fits and est.nvme.problems[0].startswith("NVMe I/O")
    out = capfd.readouterr().out
    assert "NVMe tier: **does NOT fit**" in out and "Engram table checkpoint per node" in out


def test_step_rows_are_capped_by_the_lookup_ids():
    """Without the measured cap: 2 x 1024 tokens x 16 heads = 32,768 ids per owner; a tp 2
    group shares its sequences, so half."""
    from planner.nvme import step_rows

    many = dataclasses.replace(HW, unique_rows_per_step=10**6)
    assert step_rows(_cfg(), many, ROWS) == 32_768
    tp2 = dataclasses.replace(_cfg(), parallelism=dataclasses.replace(_cfg().parallelism, tp=2))
    assert step_rows(tp2, many, ROWS) == 16_384
    assert step_rows(_cfg(), many, 1000) == 1000  # at most the shard
