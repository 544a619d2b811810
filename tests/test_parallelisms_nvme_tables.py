"""NVMe-resident Engram tables (engram.table_location = "nvme", parallelisms/engram_tables/nvme.py
over engram/rowstore/nvme_store.py): the row store alone (pages, cache, pins, write-back,
O_DIRECT, page-ins racing updates and evictions) and training bitwise equal to device tables (losses, grad norms,
every table row) over 4 steps at 1 and 2 gloo ranks for both row-sparse optimizers, with a host
cache many times smaller than the table, on the local disk (pytest's tmp dir), so pages are
evicted and read back mid-run, and each step's pages paged in while the step before runs (the
loop reads the loader one step ahead)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from launcher import run_distributed
from shared_runs import shared_run
from tables_twins import CACHE_MIB, PP, SHARED_LAYOUTS, STEPS, device_twin, nvme_raw
from test_parallelisms_host_tables import _same

from engram.config import ConfigError, config_from_dict
from engram.rowstore import page_io
from engram.rowstore.nvme_store import INDEX_BYTES_PER_PAGE, NvmeRowStore, page_layout


def _mkdirs(root, *names: str) -> None:
    """A store's directories exist before it (check_nvme_settings creates them at start)."""
    for name in names:
        (root / name).mkdir(exist_ok=True)


def test_page_layout():
    assert page_layout(192) == (4096, 21)  # 16-wide rows + two moments: 21 records a page
    assert page_layout(68) == (4096, 60)
    assert page_layout(5000) == (8192, 1)  # a record never crosses a page


def _direct_io_works(folder) -> bool:
    import os

    try:
        os.close(os.open(folder / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("engine", ["aio", "syscalls"])
def test_row_store_roundtrip_eviction_and_pins(tmp_path, monkeypatch, engine):
    _page_io(monkeypatch, engine)
    rows, dim = 5000, 8
    _mkdirs(tmp_path, "a", "b")
    store = NvmeRowStore(
        rows, {"weight": dim, "exp_avg": dim, "sum": 0}, [str(tmp_path / "a"), str(tmp_path / "b")],
        cache_bytes=4 * 4096,
    )  # fmt: skip
    assert store.direct == _direct_io_works(tmp_path)  # else buffered, with the reason logged
    # the host memory it keeps per page besides the cache (the planner's page index term)
    index = (store.cache.slot_of, store.io.sums, store.io.written, store.cache.writing)
    assert all(len(t) == store.pages for t in index)
    assert sum(t.element_size() for t in index) == INDEX_BYTES_PER_PAGE
    w, m, s = torch.randn(rows, dim), torch.randn(rows, dim), torch.rand(rows)
    store.load({"weight": w, "exp_avg": m, "sum": s})
    assert store.writes > 0 and store.cached_bytes <= 4 * 4096  # evicted pages went to disk
    idx = torch.tensor([4999, 3, 2500, 7])
    got = store.read_columns(idx)
    assert torch.equal(got["weight"], w[idx]) and torch.equal(got["exp_avg"], m[idx])
    assert torch.equal(got["sum"], s[idx])
    s[idx] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    store.write_columns(idx, {"sum": s[idx]})
    store.pin(torch.tensor([0, 1]))  # page 0, held while everything else streams through
    for r in range(0, rows, 97):
        store.read_rows(torch.tensor([r]))
    assert 0 in store.cache.cached()
    with pytest.raises(RuntimeError, match="nvme_host_cache_gib"):
        store.pin(torch.arange(0, rows, store.rows_per_page))  # a "step" larger than the cache
    store.release_all()
    assert torch.equal(store.snapshot(), w) and torch.equal(store.snapshot("sum"), s)
    assert torch.equal(store.snapshot("exp_avg"), m)
    store.close()


def _page_io(monkeypatch, engine: str) -> None:
    """Page I/O by native AIO batches (the default where O_DIRECT works) or by preadv / pwritev."""
    if engine == "syscalls":
        monkeypatch.setattr(page_io, "aio_available", lambda: "off for this test")


@pytest.mark.parametrize("engine", ["aio", "syscalls"])
def test_page_in_racing_updates_and_evictions_returns_current_rows(tmp_path, monkeypatch, engine):
    """Page-ins whose reads and write-backs are slowed (so they are still in flight): a page
    step N dirtied and a page-in evicted is read again only after its write-back; a page being
    paged in and then written is not overwritten by the late read; snapshot sees every update."""
    import os
    import time

    _page_io(monkeypatch, engine)
    rows, dim = 320, 64  # 16 rows a page, 20 pages, 6 cached
    _mkdirs(tmp_path, "a", "b")
    store = NvmeRowStore(rows, {"weight": dim}, [str(tmp_path / "a"), str(tmp_path / "b")],
                         cache_bytes=6 * 4096)  # fmt: skip
    assert (store.io.aio is not None) == (engine == "aio" and _direct_io_works(tmp_path))
    w = torch.randn(rows, dim)
    store.load({"weight": w})
    store.flush()  # clean: only the page-in's write-backs below are slow to reach the disk
    # write-backs slower than reads: a read that did not wait would win
    if store.io.aio is not None:
        run = store.io.aio.run

        def slow_batch(fds, addrs, offsets, nbytes, write):
            time.sleep(0.3 if write else 0.05)
            return run(fds, addrs, offsets, nbytes, write)

        monkeypatch.setattr(store.io.aio, "run", slow_batch)
    else:
        real = {"preadv": os.preadv, "pwritev": os.pwritev}

        def slow(name):
            def move(*args):
                time.sleep(0.3 if name == "pwritev" else 0.05)
                return real[name](*args)

            return move

        monkeypatch.setattr(os, "preadv", slow("preadv"))
        monkeypatch.setattr(os, "pwritev", slow("pwritev"))
    page = store.rows_per_page
    step_n = torch.arange(0, 2 * page)  # pages 0, 1: step N pins and updates them
    store.pin(step_n)
    w[step_n] += 1.0
    store.write_rows(step_n, w[step_n])
    store.release_all()
    for p in sorted(p for p in store.cache.cached().tolist() if p > 1):  # 0, 1 the least recent
        store.read_rows(torch.tensor([p * page]))
    store.page_in_now(torch.arange(4 * page, 6 * page))  # pages 4, 5: evicts dirty pages 0, 1
    writing, loading = store.cache.in_flight()
    assert set(writing.tolist()) == {0, 1} and set(loading.tolist()) == {4, 5}
    assert torch.equal(store.read_rows(torch.tensor([3, page + 5])), w[[3, page + 5]])
    store.page_in_now(torch.arange(10 * page, 11 * page))  # page 10, read in flight
    assert 10 in store.cache.in_flight()[1]
    w[10 * page : 11 * page] = -7.0
    store.write_rows(torch.arange(10 * page, 11 * page), w[10 * page : 11 * page])
    assert store.page_in_waits >= 1 and store.paged_in == 3
    got = torch.cat([store.read_rows(torch.arange(r, r + page)) for r in range(0, rows, page)])
    assert torch.equal(got, w) and torch.equal(store.snapshot(), w)
    store.page_in_now(torch.arange(rows))  # more than the cache: pages in what fits, no error
    assert torch.equal(store.snapshot(), w)
    store.close()


def test_adjacent_pages_move_in_one_call(tmp_path, monkeypatch):
    """Without native AIO, pages adjacent in one file are read in one preadv (into their
    scattered slots)."""
    import os

    _page_io(monkeypatch, "syscalls")
    _mkdirs(tmp_path, "a", "b")
    store = NvmeRowStore(16 * 40, {"weight": 64}, [str(tmp_path / "a"), str(tmp_path / "b")],
                         cache_bytes=12 * 4096)  # fmt: skip
    w = torch.randn(16 * 40, 64)
    store.load({"weight": w})
    store.flush()
    store.read_rows(torch.arange(16 * 30, 16 * 40))  # pages 30-39 cached: 0-9 are not
    calls, real = [], os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: calls.append(len(a[1])) or real(*a))
    assert torch.equal(store.read_rows(torch.arange(16 * 10)), w[: 16 * 10])
    assert sorted(calls) == [5, 5]  # pages 0, 2, .. 8 of file a and 1, 3, .. 9 of file b
    store.close()


def test_nvme_needs_dirs_and_a_row_sparse_optimizer():
    with pytest.raises(ConfigError, match="nvme_dirs"):
        config_from_dict(
            {"engram": {"table_location": "nvme"}, "optimizer": {"table_optimizer": "lazy_adam"}}
        )
    with pytest.raises(ConfigError, match="lazy_adam or rowwise_adagrad"):
        config_from_dict({"engram": {"table_location": "nvme", "nvme_dirs": ["/tmp"]}})
    # NVMe settings without table_location = "nvme" were ignored (the DeepSpeed recipe refused
    # them by its own rule): both recipes now read the config's one check.
    for setting in (
        {"nvme_dirs": ["/tmp"]},
        {"nvme_host_cache_gib": 8.0},
        {"nvme_create_dirs": True},
    ):
        (name,) = setting
        for location in ("device", "host"):
            with pytest.raises(ConfigError, match=rf'engram.{name} is set .* = "{location}".*'
                               r'set table_location = "nvme" or remove'):  # fmt: skip
                config_from_dict({"engram": {"table_location": location, **setting}})


def _stores_of(model_parts) -> list:
    from parallelisms.engram_tables import NvmeShardedEngramTable

    return [
        m._engram_store for part in model_parts for m in part.modules()
        if isinstance(m, NvmeShardedEngramTable)
    ]  # fmt: skip


def _train(rank: int, world: int, raw: dict, chunk_bytes: int = 0) -> dict:
    """Train `raw`; the losses, grad norms, every table and per NVMe store its page counts (at
    the first step: what the init or the resume read and wrote) and the largest write of rows
    into it by a resume (`load`, inside the checkpoint's load); the stores' I/O counters' growth
    from the step's build to the end, rank 0's metrics and the tier's start-up lines.
    `chunk_bytes`: the checkpoint's streamed chunks (CHUNK_BYTES), if not the default."""
    import logging
    from pathlib import Path

    import engram.checkpoint.manager as manager
    import engram.rowstore.streamed_columns as sc
    import recipes.train as recipe
    import runner.step as step_mod
    from engram.optim.lazy_adam import RowSparseOptimizer
    from engram.rowstore.host_worker import row_store_of
    from engram.rowstore.nvme_store import NvmeRowStore
    from parallelisms.engram_tables import NvmeShardedEngramTable
    from runner.step import TrainStep

    # The stores' own page counters when the step is built (after init) and at the end; the
    # start-up lines the run logged.
    init, at_build, lines = TrainStep.__init__, [], []

    def counted_from_here(self, *args, **kwargs):
        init(self, *args, **kwargs)
        at_build.extend(s.io_counters() for s in _stores_of(self.model_parts))

    TrainStep.__init__ = counted_from_here
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("engram").addHandler(handler)

    sc.CHUNK_BYTES = chunk_bytes or sc.CHUNK_BYTES
    update, call, load = RowSparseOptimizer._update, step_mod.TrainStep.__call__, NvmeRowStore.load
    resume = manager.CheckpointManager.load
    unpinned = [0]  # updates of rows whose pages no prefetch pinned
    at_start: dict[int, tuple[int, int]] = {}  # store -> (reads, writes) before step 1
    loads: dict[int, int] = {}  # store -> the most bytes one load of the resume wrote
    resuming = [False]

    def first_step(self, *args, **kwargs):
        for part in self.model_parts if not at_start else ():
            for m in part.modules():
                if isinstance(m, NvmeShardedEngramTable) and m._engram_store is not None:
                    at_start[id(m._engram_store)] = (m._engram_store.reads, m._engram_store.writes)
        return call(self, *args, **kwargs)

    def counted_load(self, values, *args, **kwargs):
        if resuming[0]:
            nbytes = sum(v.nbytes for v in values.values())
            loads[id(self)] = max(loads.get(id(self), 0), nbytes)
        return load(self, values, *args, **kwargs)

    def counted_resume(self):
        resuming[0] = True
        try:
            return resume(self)
        finally:
            resuming[0] = False

    step_mod.TrainStep.__call__ = first_step
    NvmeRowStore.load = counted_load
    manager.CheckpointManager.load = counted_resume

    def checked(self, p, hyper, rows, g):
        store = row_store_of(p)
        if store is not None and rows.numel():
            unpinned[0] += not bool(store.cache.pinned(store._pages(rows)).all())
        return update(self, p, hyper, rows, g)

    RowSparseOptimizer._update = checked
    result = recipe.train(config_from_dict(raw))
    at_end = [s.io_counters() for s in _stores_of(result.model_parts)]  # before the read-out
    tables, stores = {}, []
    for part in result.model_parts:
        state = part.state_dict()  # an NVMe table's rows come from its store
        for n, v in state.items():
            if ".table." in n:
                tables[n] = v.full_tensor().detach().clone()
        for m in part.modules():
            if isinstance(m, NvmeShardedEngramTable):
                s = m._engram_store
                stores.append(
                    {"reads": s.reads, "writes": s.writes, "cache": s.cache_pages * s.page_bytes,
                     "pins": s.pins_taken, "paged_in": s.paged_in,
                     "table": s.rows * s.columns["weight"] * 4, "pages": s.pages,
                     "start": at_start.get(id(s)), "largest_load": loads.get(id(s), 0)}
                )  # fmt: skip
    grew = {
        k: sum(e[k] - b[k] for b, e in zip(at_build, at_end, strict=True)) for k in at_end[0]
    } if at_end else {}  # fmt: skip
    metrics = Path(raw["job"]["dump_folder"]) / raw["job"]["run_name"] / "metrics.jsonl"
    return {
        "losses": result.losses, "norms": result.grad_norms, "tables": tables, "stores": stores,
        "unpinned": unpinned[0], "io_grew": grew,
        "metrics": [json.loads(x) for x in metrics.read_text().splitlines()] if rank == 0 else [],
        "tier_lines": [x for x in lines if x.startswith("table tier:")],
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["lazy_adam", "rowwise_adagrad"])
@pytest.mark.parametrize("world", [1, 2])
def test_nvme_equals_device(tmp_path, world, opt):
    """... and logs, per rank, the tier's start-up line and, per step, Engram telemetry equal
    to the device run's and page counters that add up to the stores' own counts."""
    # the device twin: test_nvme_checkpoint_resumes_bitwise[nvme]'s reference at 2 ranks
    twin = nvme_raw(tmp_path, f"{opt}{world}", world, "device", opt)
    runs = {"device": shared_run(device_twin, world, twin)}
    raw = nvme_raw(tmp_path, f"{opt}{world}", world, "nvme", opt)
    raw["engram"]["nvme_probe_s"] = 0.05
    raw["metrics"]["enable_tensorboard"] = True
    runs["nvme"] = run_distributed(_train, world, raw)
    assert not list(tmp_path.glob("nvme_*/*.pages"))  # the ranks deleted their page files
    for rank, (n, d) in enumerate(zip(runs["nvme"], runs["device"], strict=True)):
        where = f"{opt} world {world} rank {rank}"
        assert len(n["losses"]) == STEPS
        assert _same(n["losses"], d["losses"]), f"{where}: {n['losses']} != {d['losses']}"
        assert _same(n["norms"], d["norms"]), f"{where}: {n['norms']} != {d['norms']}"
        assert n["tables"].keys() == d["tables"].keys() and n["tables"]
        for k, t in d["tables"].items():
            assert np.array_equal(n["tables"][k], t), f"{where}: table {k} differs"
        assert n["stores"] and not d["stores"]
        for s in n["stores"]:
            assert s["table"] >= 8 * s["cache"], s  # the host cache is far smaller than the table
            # the init wrote every page (all but what it left cached) and read none
            assert s["start"][0] == 0 and s["start"][1] >= s["pages"] - s["cache"] // 4096, s
            assert s["writes"] > 0 and s["reads"] > 0, s  # evicted, written back and read again
            assert s["pins"] == STEPS, s  # every step's rows came pinned by a prefetch
            assert s["paged_in"] > 0, s  # steps 2-6 were paged in while the step before ran
        assert n["unpinned"] == 0, where  # and stayed pinned until their update
    _check_telemetry(runs, world, tmp_path / f"{opt}{world}_nvme")


def _check_telemetry(runs: dict, world: int, nvme_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    nvme, device = runs["nvme"][0], runs["device"][0]
    assert [m["step"] for m in nvme["metrics"] if "loss" in m] == list(range(1, STEPS + 1))
    for n, d in zip(nvme["metrics"], device["metrics"], strict=True):
        engram = {k: v for k, v in d.items() if k.startswith("engram/")}
        assert len(engram) == 6 and engram["engram/layer_1/rows_touched"] > 0, d
        assert {k: n[k] for k in engram} == engram  # NVMe tables: the same numbers, bitwise
        assert not any(k.startswith("tier/") for k in d)
    # The page counters of the windows add up to what the stores counted from the first step on.
    grew = {k: sum(r["io_grew"][k] for r in runs["nvme"]) for k in runs["nvme"][0]["io_grew"]}
    for key in ("pages_read_demand", "pages_read_ahead", "pages_written"):
        assert sum(m[f"tier/{key}"] for m in nvme["metrics"]) == grew[key], key
    assert grew["pages_read_ahead"] > 0 and grew["pages_written"] > 0, grew
    assert sum(m["tier/page_in_wait_s"] for m in nvme["metrics"]) == pytest.approx(
        grew["page_in_wait_s"], rel=1e-4, abs=1e-6
    )
    assert all(0 <= m["tier/cache_hit_pct"] <= 100 for m in nvme["metrics"])
    assert all(m["tier/io_mb_s"] >= 0 for m in nvme["metrics"])
    # One start-up line per rank, on rank 0's log.
    lines = nvme["tier_lines"]
    assert len(lines) == world and all(f"rank {r}: " in lines[r] for r in range(world)), lines
    assert "NVMe table(s), page files" in lines[0] and "page I/O" in lines[0], lines
    assert "O_DIRECT" in lines[0] and "random 4 KiB reads/s" in lines[0], lines
    acc = EventAccumulator(str(nvme_run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"engram/layer_1/gate_mean", "engram/layer_1/update_rms", "tier/pages_written"} <= tags


@pytest.mark.slow
@pytest.mark.parametrize("first", ["nvme", "device"])
def test_nvme_checkpoint_resumes_bitwise(tmp_path, first):
    """Steps 1-4 with `first`, saved at 2 (DCP, the rows and moments read from the store),
    resumed at steps 3-4 with NVMe tables in fresh page files: equal to 4 device-table steps
    (2 ranks). Saved in chunks of 256 KiB: the resume writes the store a window of at most 256 KiB
    of records at a time (a device table's checkpoint holds a rank's whole column as one chunk:
    ~1.6 MB) and reads no page back."""
    chunk = 256 << 10

    def ckpt(location: str, load_step: int) -> dict:
        raw = nvme_raw(tmp_path, "ckpt", 2, location, "lazy_adam")
        raw["job"]["run_name"] = "resume"
        raw["checkpoint"] = {"enable": True, "interval": 2, "keep_latest_k": 0,
                             "load_step": load_step}  # fmt: skip
        return raw

    saved = run_distributed(_train, 2, ckpt(first, -1), chunk)  # 4 steps, saved at 2 and 4
    ref = (  # test_nvme_equals_device[2-lazy_adam]'s device twin
        saved
        if first == "device"
        else shared_run(device_twin, 2, nvme_raw(tmp_path / "ref", "ref", 2, "device", "lazy_adam"))
    )
    resumed = run_distributed(_train, 2, ckpt("nvme", 2), chunk)
    for r, got in zip(ref, resumed, strict=True):
        assert _same(got["losses"], r["losses"][2:]), (got["losses"], r["losses"])
        for n, t in r["tables"].items():
            assert np.array_equal(got["tables"][n], t), n
        for s in got["stores"]:  # the resume's windows: each at most a chunk
            assert s["start"][0] == 0 and 0 < s["largest_load"] <= chunk < s["table"], s


def test_planner_models_nvme():
    """The planner models the NVMe tier (planner/nvme.py; its terms are tested in
    tests/test_planner_nvme.py): check_modelled accepts it."""
    from planner.registry import check_modelled

    cfg = config_from_dict(
        {"engram": {"table_location": "nvme", "nvme_dirs": ["/tmp/x"]},
         "optimizer": {"table_optimizer": "lazy_adam"}}
    )  # fmt: skip
    check_modelled(cfg)


@pytest.mark.slow
def test_nvme_equals_device_fsdp2_tp2_and_pp2(tmp_path):
    """FSDP2 x TP2 (4 ranks), PP2 and PP2 x TP2 (1F1B, 2 micro-batches, Engram on both stages):
    bitwise like device tables over 4 steps, with prefetch: every lookup's rows came pinned by
    a prefetch (each TP rank its own sequence piece, each stage per schedule micro-batch) and
    stayed pinned until the optimizer's update, and the next step's pages were paged in while a
    step ran (the same lookups, a step ahead)."""
    layouts = {  # label: (ranks, extra, prefetches per table and rank, cache MiB per rank)
        "fsdp2tp2": (*SHARED_LAYOUTS["fsdp2tp2"], STEPS, CACHE_MIB / 4),
        # a stage's table over 1 (2) ranks: ~10x its cache; it pins 2 micro-batches' rows
        "pp2": (2, {"parallelism": {"dp_shard": 1, "pp": 2}, **PP}, 2 * STEPS, CACHE_MIB),
        "pp2tp2": (*SHARED_LAYOUTS["pp2tp2"], 2 * STEPS, 2.3),
    }  # fmt: skip
    telemetry = {}  # label -> rank 0's metrics of the NVMe run
    for label, (world, extra, prefetches, cache_mib) in layouts.items():
        # no other test trains these twins (the host file's layouts use their own table size)
        twin = nvme_raw(tmp_path, label, world, "device", "lazy_adam", extra)
        runs = {"device": run_distributed(device_twin, world, twin)}
        raw = nvme_raw(tmp_path, label, world, "nvme", "lazy_adam", extra)
        raw["engram"]["nvme_host_cache_gib"] = cache_mib / 1024
        runs["nvme"] = run_distributed(_train, world, raw)
        for rank, (n, d) in enumerate(zip(runs["nvme"], runs["device"], strict=True)):
            where = f"{label} rank {rank}"
            assert _same(n["losses"], d["losses"]), f"{where}: {n['losses']} != {d['losses']}"
            assert _same(n["norms"], d["norms"]), where
            for k, t in d["tables"].items():
                assert np.array_equal(n["tables"][k], t), f"{where}: table {k} differs"
            assert n["stores"], where
            for s in n["stores"]:
                assert s["pins"] == prefetches and s["reads"] > 0, f"{where}: {s}"
                assert s["paged_in"] > 0, f"{where}: {s}"  # paged in while the step before ran
                assert s["table"] >= 8 * s["cache"], s
            assert n["unpinned"] == 0, where
        telemetry[label] = runs["nvme"][0]["metrics"]
        for n, d in zip(runs["nvme"][0]["metrics"], runs["device"][0]["metrics"], strict=True):
            assert {k: v for k, v in n.items() if k.startswith("engram/")} == {
                k: v for k, v in d.items() if k.startswith("engram/")
            }, label
    # Engram telemetry of both stages' layers, each rank's own tokens: PP2 x TP2 = PP2 at step 1
    # (same weights, same global batch; sums in another order)
    for key, value in telemetry["pp2"][0].items():
        if key.startswith("engram/"):
            assert telemetry["pp2tp2"][0][key] == pytest.approx(value, rel=1e-5), key
    assert {"engram/layer_0/gate_mean", "engram/layer_2/rows_touched"} <= telemetry["pp2"][0].keys()


def test_buffered_fallback_when_o_direct_is_refused(tmp_path, monkeypatch, caplog):
    """A file system that refuses O_DIRECT (tmpfs: EINVAL) gets buffered I/O, the reason logged,
    and the same rows."""
    import errno
    import os

    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level("WARNING"):
        store = NvmeRowStore(300, {"weight": 4}, [str(tmp_path)], cache_bytes=4096)
    assert not store.direct
    assert "buffered I/O" in caplog.text and "refuses O_DIRECT" in caplog.text
    w = torch.randn(300, 4)
    store.load({"weight": w})
    assert torch.equal(store.snapshot(), w) and store.writes > 0
    store.close()
