"""Host-resident Engram tables (engram.table_location = "host", parallelisms/engram_tables/host.py).

`host` must train bitwise like `device` (losses, grad norms, table rows after several steps) for
both row-sparse table optimizers, at 1 / 2 / 4 gloo ranks, with grad accumulation, activation
checkpointing (which must not re-run a lookup), DDP, FSDP2 x TP2, PP2 and the non-finite guard;
checkpoints interchange host <-> device exactly, async saves wait for queued host updates (equal
to sync saves bitwise under FSDP2, FSDP2 x TP2 and HSDP, both optimizers), and host checkpoints
reshard to more and fewer ranks like device ones; dense adam is refused. On this CPU machine host
and device memory are the same, so these tests check the host code path (host gather through the
FIFO worker, prefetch, async host update, replay under recompute), not page-locked copies.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from launcher import run_distributed
from shared_runs import shared_run
from tables_twins import PP, SHARED_LAYOUTS, device_twin, table_raw

from engram.config import ConfigError, config_from_dict

ROW_SPARSE = ("lazy_adam", "rowwise_adagrad")


def _train(
    rank: int, world: int, raw: dict, nan_steps: tuple[int, ...] = (), slow_update: float = 0.0
) -> dict:
    """Train; return losses, grad norms, full table rows and how often the host path routed
    ids / gathered rows / consumed a prefetch. `slow_update`: seconds every row-sparse update
    sleeps first (on the host worker for host tables), so a reader that does not wait for the
    worker sees the rows before the update."""
    from torch.distributed.tensor import DTensor

    import engram.rowstore.memory as rs
    import parallelisms.engram_tables.host as ht
    import recipes.train as recipe
    from engram.optim.lazy_adam import RowSparseOptimizer

    counts = {"route": 0, "gather": 0, "prefetch": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    ht.route_ids = counted("route", ht.route_ids)
    rs._gather = counted("gather", rs._gather)
    ht.HostShardedEngramTable.prefetch = counted("prefetch", ht.HostShardedEngramTable.prefetch)
    if slow_update:
        update_all = RowSparseOptimizer._update_all

        def slow(self, work, stats=None):
            time.sleep(slow_update)
            update_all(self, work, stats)

        RowSparseOptimizer._update_all = slow
    if nan_steps:
        from test_recipes_faults import poison_loss

        poison_loss(nan_steps)
    result = recipe.train(config_from_dict(raw))
    tables, where = {}, {}
    for part in result.model_parts:
        for n, p in part.named_parameters():
            if ".table." in n:
                tables[n] = p.full_tensor().detach().clone() if isinstance(p, DTensor) else p
                where[n] = (p.to_local() if isinstance(p, DTensor) else p).device.type
    run = Path(raw["job"]["dump_folder"]) / raw["job"]["run_name"]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]  # a step's record, not an eval_loss one
    telemetry = [  # rank 0's Engram telemetry of this run's steps (engram/train/telemetry.py;
        # runs resuming each other share the run folder and append to its metrics.jsonl)
        {k: v for k, v in r.items() if k.startswith("engram/")}
        for r in steps[len(steps) - len(result.losses) :]
    ] if rank == 0 else []  # fmt: skip
    return {
        "losses": result.losses,
        "norms": result.grad_norms,
        "tables": tables,
        "counts": counts,
        "telemetry": telemetry,
        "host_tables": [
            type(m).__name__ for m in result.model.modules() if "Host" in type(m).__name__
        ],
    }


def _same(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def _assert_bitwise(host: list[dict], device: list[dict], label: str) -> None:
    for rank, (h, d) in enumerate(zip(host, device, strict=True)):
        where = f"{label} rank {rank}"
        assert h["host_tables"] and not d["host_tables"], where
        assert _same(h["losses"], d["losses"]), f"{where}: {h['losses']} != {d['losses']}"
        assert _same(h["norms"], d["norms"]), f"{where}: {h['norms']} != {d['norms']}"
        assert h["tables"].keys() == d["tables"].keys()
        for n, t in d["tables"].items():
            assert np.array_equal(h["tables"][n], t), f"{where}: table {n} differs"
        # Engram telemetry (gates, rows touched, the update's RMS from the host worker): equal,
        # up to the order a sum of squares adds in (out_rms_ratio 6e-8 apart after the 4 -> 2
        # reshard resume, its losses and tables bitwise)
        assert len(h["telemetry"]) == len(d["telemetry"]), where
        for ht, dt in zip(h["telemetry"], d["telemetry"], strict=True):
            assert ht == pytest.approx(dt, rel=1e-6, abs=0), where
        assert rank or all(len(t) % 6 == 0 and t for t in h["telemetry"]), h["telemetry"]


def _pair(tmp, name, world, opt, extra=None, nan_steps=()):
    """The host run and its device twin of one config, each trained once per session
    (tests/shared_runs.py: the 2-rank lazy_adam runs are also
    test_checkpoint_interchange_host_device's references)."""
    args = (nan_steps,) if nan_steps else ()
    host = shared_run(_train, world, table_raw(str(tmp), name, world, "host", opt, extra), *args)
    device = shared_run(
        device_twin, world, table_raw(str(tmp), name, world, "device", opt, extra), *args
    )
    return host, device


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_host_equals_device_lazy_adam(tmp_path, world):
    host, device = _pair(tmp_path, "lazy", world, "lazy_adam")
    _assert_bitwise(host, device, f"lazy_adam world {world}")
    # every step's lookup came through a prefetch (4 steps x 1 table), none gathered late
    assert host[0]["counts"] == {"route": 4, "gather": 4, "prefetch": 4}


@pytest.mark.slow
def test_host_tables_learn(tmp_path):
    """The compared runs update the tables (a frozen table would also compare equal)."""
    raw = table_raw(str(tmp_path), "learn", 1, "host", "lazy_adam")
    (four,) = shared_run(_train, 1, raw)  # test_host_equals_device_lazy_adam[1]'s host run
    steps0 = {**raw, "training": {**raw["training"], "steps": 1}}
    steps0["job"] = {**raw["job"], "run_name": "learn_one_step"}
    (one,) = run_distributed(_train, 1, steps0)
    for n, t in one["tables"].items():
        assert not np.array_equal(t, four["tables"][n])


@pytest.mark.slow
def test_host_equals_device_rowwise_adagrad_accum_ac(tmp_path):
    """rowwise_adagrad, 2 ranks, 2 micro-batches per step, every layer checkpointed: the
    recompute replays the forward's rows (route / gather once per lookup, not twice)."""
    extra = {
        "training": {"grad_accum_steps": 2},
        "activation_checkpoint": {"mode": "full"},
    }
    host, device = _pair(tmp_path, "adagrad", 2, "rowwise_adagrad", extra)
    _assert_bitwise(host, device, "rowwise_adagrad accum 2 + AC")
    assert host[0]["counts"] == {"route": 8, "gather": 8, "prefetch": 8}


@pytest.mark.slow
def test_host_equals_device_hsdp_compile_engram_only(tmp_path):
    """HSDP 2x2, compiled blocks (aot_eager; the lookup stays eager), engram_only mode."""
    extra = {
        "parallelism": {"dp_replicate": 2, "dp_shard": 2},
        "compile": {"enable": True, "backend": "aot_eager"},
        "training": {"mode": "engram_only"},
    }
    host, device = _pair(tmp_path, "hsdp", 4, "lazy_adam", extra)
    _assert_bitwise(host, device, "HSDP 2x2 + compile + engram_only")
    assert host[0]["counts"] == {"route": 4, "gather": 4, "prefetch": 4}


@pytest.mark.slow
def test_host_equals_device_fsdp2_tp2_and_pp2(tmp_path):
    """FSDP2 x TP2, PP2 (1F1B), PP2 x TP2, interleaved PP2 and CP2 x TP2 over 4 steps, prefetch
    on: every lookup's rows were prefetched (each TP rank its own sequence piece, each stage its
    tables per schedule micro-batch, parallelisms/table_prefetch.py). The only lookups routed and
    gathered when they run are torch's pipeline metadata forwards, which leave the queues alone
    (one each time the schedule initialises its stage), and PP2's held-out evaluation: 1 (step 1)
    + 3 (eval at step 2: a metadata forward, 2 micro-batches) + 1 (step 3 re-initialises for
    training) + 3 (eval at step 4) = 8. Interleaved1F1B (4 stages, rank 0 holds the tables of
    layers 0 and 2, rank 1 of layer 1) with every layer checkpointed: a stage's recompute replays
    its rows. CP2 x TP2: each rank looks up its TP piece of its CP chunks."""
    steps = 4
    evals = {"eval_every": 2, "eval_batches": 1}
    interleaved = {
        "pipeline": {"schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 2},
        "engram": {"layer_ids": [0, 1, 2]},
        "activation_checkpoint": {"mode": "full"},
    }
    s = steps
    layouts = {  # label: (ranks, extra, per rank: lookups (tables x micro-batches x steps), late)
        "fsdp2tp2": (*SHARED_LAYOUTS["fsdp2tp2"], [s] * 4, [0] * 4),
        "pp2": (2, {"parallelism": {"dp_shard": 1, "pp": 2}, **PP, "data": evals}, [2 * s] * 2,
                [8] * 2),
        "pp2tp2": (*SHARED_LAYOUTS["pp2tp2"], [2 * s] * 4, [1] * 4),
        "pp2_interleaved_ac": (2, {"parallelism": {"dp_shard": 1, "pp": 2}, **interleaved},
                               [4 * s, 2 * s], [2, 1]),
        "cp2tp2": (4, {"parallelism": {"dp_shard": 1, "cp": 2, "tp": 2,
                                       "cp_method": "allgather_kv"},
                       "training": {"seq_len": 128}, "engram": {"layer_ids": [0, 2]}},
                   [2 * s] * 4, [0] * 4),
    }  # fmt: skip
    for label, (world, extra, lookups, late) in layouts.items():
        extra = {**extra, "training": {**extra.get("training", {}), "steps": steps}}
        host, device = _pair(tmp_path, label, world, "lazy_adam", extra)
        _assert_bitwise(host, device, label)
        for rank, h in enumerate(host):
            n, m = lookups[rank], late[rank]
            want = {"route": n + m, "gather": n + m, "prefetch": n}
            assert h["counts"] == want, f"{label} rank {rank}: {h['counts']}"


@pytest.mark.slow
def test_nonfinite_step_leaves_host_rows_alone(tmp_path):
    extra = {"training": {"max_nonfinite_steps": 2}}
    host, device = _pair(tmp_path, "nan", 2, "lazy_adam", extra, nan_steps=(2,))
    assert math.isnan(host[0]["losses"][1])
    _assert_bitwise(host, device, "non-finite step 2")


def _ckpt_raw(
    tmp: str,
    world: int,
    location: str,
    load_step: int,
    opt: str = "lazy_adam",
    extra: dict | None = None,
) -> dict:
    raw = table_raw(tmp, "ckpt", world, location, opt, extra)
    raw["job"]["run_name"] = "interchange"  # one folder: the locations resume each other
    raw["checkpoint"] = {"enable": True, "interval": 2, "keep_latest_k": 0, "load_step": load_step}
    return raw


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [("host", "device"), ("device", "host"), ("host", "host")])
def test_checkpoint_interchange_host_device(tmp_path, first, second):
    """Steps 1-2 with one location, resume steps 3-4 with the other: equal to 4 steps with the
    second location throughout (2 ranks)."""
    # test_host_equals_device_lazy_adam[2]'s run (and twin)
    fn = device_twin if second == "device" else _train
    ref = shared_run(fn, 2, table_raw(str(tmp_path / "ref"), "ref", 2, second, "lazy_adam"))
    run_distributed(_train, 2, _ckpt_raw(str(tmp_path), 2, first, -1))
    resumed = run_distributed(_train, 2, _ckpt_raw(str(tmp_path), 2, second, 2))
    for r, got in zip(ref, resumed, strict=True):
        assert got["losses"] == r["losses"][2:]
        for n, t in r["tables"].items():
            assert np.array_equal(got["tables"][n], t), n


def test_dense_adam_refused_with_host_tables():
    with pytest.raises(ConfigError, match="lazy_adam or rowwise_adagrad"):
        config_from_dict({"engram": {"table_location": "host"}})
    with pytest.raises(ConfigError, match="engram.table_location must be one of device, host"):
        config_from_dict({"engram": {"table_location": "disk"}})


def _shard_worker(rank: int, world: int) -> dict:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from engram.models.engram import EngramTable
    from engram.optim.builder import build_table_optimizer
    from parallelisms.engram_tables import apply_engram_table_sharding

    with torch.device("meta"):
        model = nn.ModuleList([EngramTable(101, 4), nn.Linear(4, 4)])
    mesh = init_device_mesh("cpu", (world,))
    params = apply_engram_table_sharding(
        model, mesh, grad_scale=1.0 / world, row_sparse=True, location="host"
    )
    model.to_empty(device=torch.device("meta"))  # everything else to meta: the shard stays
    local = model[0].weight.to_local()
    model.to(torch.device("meta"))
    moved = model[0].weight.to_local()
    out = {"table": local.device.type, "after_to": moved.device.type, "rows": local.shape[0]}
    out["linear"] = model[1].weight.device.type
    try:
        build_table_optimizer("adam", [{"params": params, "lr": 1e-3}], (0.9, 0.99), 1e-8)
    except ValueError as e:
        out["adam"] = str(e)
    return out


def _queue_worker(rank: int, world: int) -> dict:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from engram.models.engram import EngramTable
    from parallelisms.engram_tables import apply_engram_table_sharding
    from parallelisms.engram_tables.host import lookups_off_queue

    with torch.device("meta"):
        model = nn.ModuleList([EngramTable(101, 4)])
    mesh = init_device_mesh("cpu", (world,))
    apply_engram_table_sharding(model, mesh, grad_scale=1.0, row_sparse=True, location="host")
    model.to_empty(device=torch.device("cpu"))
    table = model[0]
    with torch.no_grad():
        table.weight.to_local().copy_(torch.arange(101 * 4.0).view(101, 4))
    a, b = torch.tensor([[1, 7], [3, 1]]), torch.tensor([[2, 5], [9, 0]])
    out: dict = {}
    table.prefetch(a)
    with lookups_off_queue():  # a forward that is not one of the step's lookups
        out["off_queue"] = table(b)
    out["queued"] = len(table._engram_prefetched)
    out["prefetched"] = table(a)
    table.prefetch(a)
    try:
        table(b)
    except RuntimeError as e:
        out["error"] = str(e)
    return out


def test_prefetched_lookup_refuses_other_ids():
    """A lookup takes its rows from the head of its table's prefetch queue only for the ids
    queued there (else it fails naming the prefetch, never using rows of other ids); a lookup
    inside lookups_off_queue (torch's pipeline metadata forward) leaves the queue alone."""
    (got,) = run_distributed(_queue_worker, 1)
    rows = np.arange(101 * 4.0, dtype=np.float32).reshape(101, 4)
    assert np.array_equal(got["off_queue"], rows[[[2, 5], [9, 0]]]) and got["queued"] == 1
    assert np.array_equal(got["prefetched"], rows[[[1, 7], [3, 1]]])
    assert "differ from the next prefetched ids" in got["error"]
    assert "parallelisms/table_prefetch.py" in got["error"]


@pytest.mark.slow
def test_shard_stays_on_host_and_adam_refused():
    results = run_distributed(_shard_worker, 2)
    assert [got["rows"] for got in results] == [51, 50]
    for got in results:
        assert got["table"] == got["after_to"] == "cpu" and got["linear"] == "meta"
        assert "lazy_adam or rowwise_adagrad" in got["adam"]


@pytest.mark.slow
def test_host_memory_too_small_fails_at_start(tmp_path):
    """The refusal names the bytes needed and available, before the tables are allocated."""
    raw = table_raw(str(tmp_path), "small", 1, "host", "lazy_adam")
    raw["engram"]["host_memory_gib"] = 0.01  # 10 MiB: less than one 64 MiB staging buffer
    with pytest.raises(RuntimeError, match=r"host Engram tables need 0\.06 GiB .* but 0\.01 GiB"):
        run_distributed(_train, 1, raw)


def test_planner_models_host_tables():
    """Host tables leave the device (only one micro-batch's rows stay), appear in host memory
    per rank and per node, are refused when the node's memory is too small, and --compare tries
    both locations. In a spawned process: the planner's fake process group must not leak into
    the processes later tests fork from this one."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        pool.apply(_planner_checks)


def _planner_checks() -> None:
    from planner.compare import compare
    from planner.estimate import estimate

    base = {
        "model": {"flavor": "debug"},
        "optimizer": {"table_optimizer": "lazy_adam"},
        "training": {"local_batch_size": 2, "seq_len": 64},
    }
    device = estimate(config_from_dict(base), 2, ranks=[0])
    host_raw = {**base, "engram": {"table_location": "host", "host_memory_gib": 64.0}}
    host = estimate(config_from_dict(host_raw), 2, ranks=[0])
    d, h = device.ranks[0], host.ranks[0]
    table_state = h.table_param_bytes + 2 * h.table_param_bytes  # weight + lazy_adam moments
    assert d.host_table_bytes == 0 and h.host_table_bytes == table_state + 64 * 2**20
    assert h.persistent_bytes == d.persistent_bytes - table_state + h.host_table_device_bytes
    assert 0 < h.host_link_bytes and host.fits
    assert host.host_table_bytes_per_node == 2 * h.host_table_bytes  # 2 ranks on the node
    small = estimate(config_from_dict(host_raw), 2, ranks=[0], host_memory_gib=0.01)
    assert not small.host_fits and not small.fits
    rows = compare(config_from_dict(base), 2, ["FSDP2"], table_locations=["device", "host"])
    assert [r.estimate.table_location for r in rows] == ["device", "host"]


def test_host_worker_failure_fails_later_jobs():
    """A gather queued after a failed update must not run on stale rows."""
    from engram.rowstore.host_worker import HostWorker

    worker = HostWorker()
    worker.submit(lambda: 1 / 0)
    later = worker.submit(lambda: "stale rows")
    with pytest.raises(RuntimeError, match="earlier host-table job failed"):
        later.result()
    with pytest.raises(ZeroDivisionError):
        worker.wait()


def test_deepspeed_recipe_refuses_host_tables():
    from runner.deepspeed_engine import check_layout

    raw = {"engram": {"table_location": "host"}, "optimizer": {"table_optimizer": "lazy_adam"}}
    with pytest.raises(ConfigError, match='table_location = "host" is not supported'):
        check_layout(config_from_dict(raw))


@pytest.mark.slow
def test_host_equals_device_ddp(tmp_path):
    """Pure data parallel (dp_replicate 2, dp_shard 1: DDP) at 2 ranks."""
    extra = {"parallelism": {"dp_replicate": 2, "dp_shard": 1}}
    host, device = _pair(tmp_path, "ddp", 2, "lazy_adam", extra)
    _assert_bitwise(host, device, "DDP 2")
    assert host[0]["counts"] == {"route": 4, "gather": 4, "prefetch": 4}


def _saved(folder, step: int) -> dict:
    """Every tensor of a committed DCP checkpoint step, read in this (non-distributed) process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (path,) = [p for p in folder.rglob(f"step-{step}") if p.is_dir()]
    dcp_to_torch_save(str(path), str(folder / f"saved{step}.pt"))
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, torch.Tensor):
            flat[prefix] = obj

    walk("", torch.load(folder / f"saved{step}.pt", weights_only=False))
    return flat


@pytest.mark.slow
def test_host_checkpoint_async_save_and_reshard(tmp_path):
    """Steps 1-4 at 2 ranks saving at 2 and 4: device tables with a sync save, host tables with
    checkpoint.async_mode = "async" (step 2's save runs in the background while step 3's host
    update is queued on the worker). Both step-2 checkpoints hold the same tensors bitwise. Each
    resumes at 1 and at 4 ranks for steps 3-4: host and device resharded runs equal bitwise, and
    their losses replay the 2-rank run's steps 3-4 to float32 reduction order."""
    first = {}
    for loc, mode in (("device", "disabled"), ("host", "async")):
        raw = _ckpt_raw(str(tmp_path / loc), 2, loc, -1)
        raw["checkpoint"]["async_mode"] = mode
        first[loc] = run_distributed(_train, 2, raw)
    dev, host = _saved(tmp_path / "device", 2), _saved(tmp_path / "host", 2)
    assert dev.keys() == host.keys() and any(".table." in k for k in dev)
    for k, t in dev.items():
        assert torch.equal(host[k], t), f"async host checkpoint differs at {k}"
    for world in (1, 4):
        resumed = {
            loc: run_distributed(_train, world, _ckpt_raw(str(tmp_path / loc), world, loc, 2))
            for loc in ("device", "host")
        }
        _assert_bitwise(resumed["host"], resumed["device"], f"resumed 2 -> {world}")
        np.testing.assert_allclose(
            resumed["host"][0]["losses"], first["host"][0]["losses"][2:], rtol=1e-5
        )


def _assert_close_to_uninterrupted(got: dict, ref: dict, before: dict, where: str) -> None:
    """Steps 3-4 resumed at another world size vs the uninterrupted run's steps 3-4, to the
    tolerances of tests/test_parallelisms_parity.py: losses rtol 1e-5; step 3's grad norm (identical
    weights) 1e-6, step 4's 1e-3; each table's update since step 2 (`before`) to 0.3% relative
    (Frobenius) and no element off by half an Adam step (lr 1e-3 x table_lr_mult 5)."""
    close = np.testing.assert_allclose
    close(got["losses"], ref["losses"][2:], rtol=1e-5, atol=0, err_msg=where)
    close(got["norms"][0], ref["norms"][2], rtol=1e-6, atol=0, err_msg=where)
    close(got["norms"], ref["norms"][2:], rtol=1e-3, atol=0, err_msg=where)
    assert got["tables"].keys() == ref["tables"].keys(), where
    for name, want in ref["tables"].items():
        update = np.linalg.norm(want - before[name])
        assert update > 0, f"{where}: table {name} did not train in steps 3-4"
        diff = got["tables"][name] - want
        assert np.linalg.norm(diff) / update < 3e-3, f"{where}: table {name} update differs"
        assert np.abs(diff).max() < 0.5 * 1e-3 * 5.0, f"{where}: table {name} max |diff|"


def _saved_tables(folder, step: int) -> dict:
    """{table parameter name: its rows} of a committed checkpoint step."""
    return {
        k.split("model.", 1)[1]: t.numpy()
        for k, t in _saved(folder, step).items()
        if k.startswith(".model.") and ".table." in k
    }


@pytest.mark.slow
def test_host_checkpoint_reshard_to_fewer_ranks(tmp_path):
    """Host tables saved at 4 ranks (FSDP over 4), resumed at 2 and at 1 rank for steps 3-4.
    Loading: the host-table resume equals bitwise a device-table resume of the same checkpoint
    (DCP's ordinary reshard of a device shard). Saving: both replay the uninterrupted 4-rank
    run's steps 3-4 to the parity tolerances (not bitwise: 2 or 1 ranks sum the gradients in
    another order)."""
    (ref, *_) = run_distributed(_train, 4, _ckpt_raw(str(tmp_path), 4, "host", -1))
    before = _saved_tables(tmp_path, 2)
    assert before.keys() == ref["tables"].keys()
    for world in (2, 1):
        resumed = {
            loc: run_distributed(_train, world, _ckpt_raw(str(tmp_path), world, loc, 2))
            for loc in ("device", "host")
        }
        _assert_bitwise(resumed["host"], resumed["device"], f"host 4 -> {world}")
        for rank, got in enumerate(resumed["host"]):
            _assert_close_to_uninterrupted(got, ref, before, f"4 -> {world} rank {rank}")


# (world, table optimizer, layout); lazy_adam at FSDP 2 is test_host_checkpoint_async_save_and_reshard
ASYNC_LAYOUTS = {
    "fsdp2tp2_lazy_adam": (4, "lazy_adam", {"parallelism": {"dp_shard": 2, "tp": 2}}),
    "hsdp2x2_rowwise_adagrad": (
        4,
        "rowwise_adagrad",
        {"parallelism": {"dp_replicate": 2, "dp_shard": 2}},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ASYNC_LAYOUTS)
def test_host_async_save_equals_sync_and_resumes(tmp_path, layout):
    """Host tables, steps 1-3 saving at 2 and 3, once with a sync save and once with
    checkpoint.async_mode = "async" (step 2's save runs in the background while step 3's host
    update is queued). Every host update first sleeps 0.2 s, so a save that does not wait for
    step 2's update would hold step 1's rows. The step-2 checkpoints hold the same tensors
    bitwise (tables and their optimizer state included), and resuming the async one at the same
    layout replays step 3 bitwise (losses, grad norms, every table row)."""
    world, opt, extra = ASYNC_LAYOUTS[layout]
    runs = {}
    for mode in ("disabled", "async"):
        raw = _ckpt_raw(str(tmp_path / mode), world, "host", -1, opt, extra)
        raw["checkpoint"]["async_mode"] = mode
        raw["training"]["steps"] = 3
        runs[mode] = run_distributed(_train, world, raw, (), 0.2)
    for a, b in zip(runs["async"], runs["disabled"], strict=True):
        assert a["host_tables"] and _same(a["losses"], b["losses"]), layout
    sync, done = _saved(tmp_path / "disabled", 2), _saved(tmp_path / "async", 2)
    assert sync.keys() == done.keys()
    table_keys = [k for k in sync if ".table." in k]
    assert any(k.startswith(".model.") for k in table_keys), table_keys
    assert any(k.startswith(".optimizer.") for k in table_keys), table_keys
    for k, t in sync.items():
        assert torch.equal(done[k], t), f"{layout}: async checkpoint differs at {k}"
    again = _ckpt_raw(str(tmp_path / "async"), world, "host", 2, opt, extra)
    again["training"]["steps"] = 3
    resumed = run_distributed(_train, world, again)
    for rank, (got, full) in enumerate(zip(resumed, runs["async"], strict=True)):
        where = f"{layout} rank {rank}"
        assert _same(got["losses"], full["losses"][2:]), where
        assert _same(got["norms"], full["norms"][2:]), where
        for n, t in full["tables"].items():
            assert np.array_equal(got["tables"][n], t), f"{where}: table {n}"
