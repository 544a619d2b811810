"""Device layer and process-group start-up.

The NPU tests use a STAND-IN torch_npu (a small file written to a temp dir that registers the
"npu" device name and a fake torch.npu module). They check our dispatch logic (hccl, visible
devices, memory, lazy import), not Ascend hardware or the real torch_npu.

Renaming torch's PrivateUse1 backend to "npu" is global and permanent in a process, so every test
that needs the stand-in runs in a forked child and leaves the pytest process untouched.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher import run_distributed

import engram.runtime.device as device
from engram.runtime.distributed import destroy_distributed, init_distributed, set_pg_timeouts

GIB = 1 << 30

FAKE_TORCH_NPU = '''
"""Stand-in torch_npu: the "npu" device name plus a fake torch.npu with 8 physical devices."""
import os
import types

import torch

torch.utils.rename_privateuse1_backend("npu")
PHYSICAL = 8


def _visible():
    # The real runtime reads ASCEND_RT_VISIBLE_DEVICES and renumbers the listed devices 0..n-1.
    var = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    ids = range(PHYSICAL) if var is None else [int(x) for x in var.split(",") if x]
    return [i for i in ids if i < PHYSICAL]


npu = types.ModuleType("torch.npu")
npu.available = True
npu.allocated = 0
npu.reserved = 0
npu.total = 64 * (1 << 30)
npu.calls = []
npu.is_available = lambda: npu.available
npu.device_count = lambda: len(_visible())
npu.set_device = lambda d: npu.calls.append(("set_device", torch.device(d)))
npu.max_memory_allocated = lambda d=None: npu.allocated
npu.max_memory_reserved = lambda d=None: npu.reserved
npu.get_device_properties = lambda d=None: types.SimpleNamespace(total_memory=npu.total)
npu.reset_peak_memory_stats = lambda d=None: npu.calls.append(("reset", torch.device(d)))
npu.synchronize = lambda d=None: npu.calls.append(("synchronize", torch.device(d)))
npu.get_rng_state = lambda d=None: npu.calls.append(("get_rng_state", d)) or torch.zeros(8, dtype=torch.uint8)
npu.set_rng_state = lambda state, d=None: npu.calls.append(("set_rng_state", d))
# torch_npu mirrors torch.cuda.memory's allocator-history API.
npu.memory = types.SimpleNamespace(
    _record_memory_history=lambda enabled="all", **kw: npu.calls.append(("history", enabled)),
    _dump_snapshot=lambda path: open(path, "wb").write(b"snapshot"),
)
torch.npu = npu
'''


@pytest.fixture
def fake_npu_dir(tmp_path: Path) -> str:
    (tmp_path / "torch_npu.py").write_text(FAKE_TORCH_NPU)
    return str(tmp_path)


def _child(fn: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    try:
        fn(*args)
        queue.put(None)
    except BaseException:
        queue.put(traceback.format_exc())


def run_forked(fn: Callable[..., Any], *args: Any) -> None:
    """Run fn(*args) in a forked child; fail the test with the child's traceback."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, queue))
    proc.start()
    error = queue.get(timeout=60)
    proc.join(timeout=10)
    if error is not None:
        pytest.fail(f"forked check failed:\n{error}", pytrace=False)


# --- stand-in NPU checks (each runs in a forked child) ----------------------------------------


def _check_lazy_import(fake_dir: str) -> None:
    sys.path.insert(0, fake_dir)
    sys.modules.pop("torch_npu", None)
    mod = importlib.reload(device)  # re-run the module body with torch_npu importable
    cpu = mod.local_device(mod.resolve_device_type("cpu"), 0)
    mod.dist_backend("cpu"), mod.memory_stats(cpu)
    mod.reset_peak_memory(cpu), mod.synchronize(cpu), mod.device_module("cpu")
    mod.dist_backend("npu"), mod.visible_devices_var("npu")  # names only: no import needed
    assert "torch_npu" not in sys.modules, "cpu path imported torch_npu"
    assert mod.resolve_device_type("npu") == "npu"
    assert "torch_npu" in sys.modules  # the stand-in was importable all along


def test_torch_npu_imported_only_for_npu(fake_npu_dir: str) -> None:
    run_forked(_check_lazy_import, fake_npu_dir)


def _check_hccl_and_visible_devices(fake_dir: str) -> None:
    sys.path.insert(0, fake_dir)
    os.environ["ASCEND_RT_VISIBLE_DEVICES"] = "4,5"
    assert device.dist_backend("npu") == "hccl"
    assert device.visible_devices_var("npu") == "ASCEND_RT_VISIBLE_DEVICES"
    assert device.resolve_device_type("npu") == "npu"
    dev = device.local_device("npu", 1)
    assert dev == torch.device("npu", 1)
    assert torch.npu.calls == [("set_device", torch.device("npu", 1))]
    try:
        device.local_device("npu", 2)
    except RuntimeError as e:
        assert "ASCEND_RT_VISIBLE_DEVICES=4,5" in str(e) and "NGPU=2" in str(e), e
    else:
        raise AssertionError("local rank 2 with 2 visible NPUs did not raise")
    # Without the variable all 8 physical devices are visible.
    del os.environ["ASCEND_RT_VISIBLE_DEVICES"]
    assert device.local_device("npu", 7) == torch.device("npu", 7)


def test_npu_uses_hccl_and_honours_visible_devices(fake_npu_dir: str) -> None:
    run_forked(_check_hccl_and_visible_devices, fake_npu_dir)


def _check_bf16_and_memory(fake_dir: str) -> None:
    sys.path.insert(0, fake_dir)
    device.import_device_backend("npu")
    npu = torch.npu
    npu.allocated, npu.reserved, npu.total = 3 * GIB, 6 * GIB, 48 * GIB
    stats = device.memory_stats(torch.device("npu", 0))
    expected = {
        "peak_allocated_gib": 3.0,
        "peak_reserved_gib": 6.0,
        "capacity_gib": 48.0,
        "peak_allocated_pct": 100 * 3 / 48,
        "peak_reserved_pct": 100 * 6 / 48,
    }
    assert stats == pytest.approx(expected)
    device.reset_peak_memory("npu:0")
    device.synchronize(torch.device("npu", 0))
    assert npu.calls == [
        ("reset", torch.device("npu", 0)),
        ("synchronize", torch.device("npu", 0)),
    ]


def test_npu_bf16_and_memory_stats(fake_npu_dir: str) -> None:
    run_forked(_check_bf16_and_memory, fake_npu_dir)


def _check_auto_and_unavailable(fake_dir: str) -> None:
    sys.path.insert(0, fake_dir)
    torch.cuda.is_available = lambda: False
    assert device.resolve_device_type("auto") == "npu"
    torch.npu.available = False
    assert device.resolve_device_type("auto") == "cpu"
    try:
        device.resolve_device_type("npu")
    except RuntimeError as e:
        assert "is_available() is False" in str(e), e
    else:
        raise AssertionError("unavailable npu did not raise")


def test_auto_prefers_npu_when_present(fake_npu_dir: str) -> None:
    run_forked(_check_auto_and_unavailable, fake_npu_dir)


# --- in-process checks (no stand-in needed) ----------------------------------------------------


def test_missing_torch_npu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install torch_npu") as info:
        device.resolve_device_type("npu")
    assert "CANN" in str(info.value)
    assert device.resolve_device_type("auto") == "cpu"


def test_backends_and_visible_vars() -> None:
    assert [device.dist_backend(t) for t in ("cuda", "npu", "cpu")] == ["nccl", "hccl", "gloo"]
    assert device.visible_devices_var("cuda") == "CUDA_VISIBLE_DEVICES"
    assert device.visible_devices_var("cpu") is None
    with pytest.raises(ValueError, match="unknown device type 'tpu'"):
        device.dist_backend("tpu")


def test_cpu_device_and_memory() -> None:
    assert device.resolve_device_type("cpu") == "cpu"
    assert device.local_device("cpu", 3) == torch.device("cpu")
    before = device.memory_stats("cpu")["max_rss_gib"]
    block = torch.ones(64 * (1 << 20) // 4)  # touch 64 MiB: peak RSS can only grow
    after = device.memory_stats("cpu")["max_rss_gib"]
    assert 0 < before <= after
    del block


def test_single_process_group_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized(), "an earlier test leaked a default process group"
    try:
        assert init_distributed("cpu", timeout_s=60) == (0, 0, 1)
        assert dist.get_backend() == "gloo"
        t = torch.arange(3.0)
        dist.all_reduce(t)
        assert torch.equal(t, torch.arange(3.0))
        assert init_distributed("cpu") == (0, 0, 1)  # already initialised: numbers only
    finally:
        destroy_distributed()
    assert not dist.is_initialized()
    destroy_distributed()  # twice is fine


def test_rank_without_world_size_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE is not"):
        init_distributed("cpu")


def _ranks(rank: int, world_size: int) -> tuple[int, int, int]:
    return init_distributed("cpu")


@pytest.mark.slow
def test_init_distributed_inside_existing_group() -> None:
    assert run_distributed(_ranks, 2) == [(0, 0, 2), (1, 1, 2)]


# --- [comm] timeouts on real gloo process groups -----------------------------------------------


def _pg_timeouts() -> list[float]:
    """The timeout each of this rank's process groups' gloo backend holds, seconds."""
    return [
        pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for pg in dist.distributed_c10d._world.pg_map
    ]


def _check_recipe_timeouts(tmp: str) -> None:
    """recipes/train.py: the default group is created with comm.init_timeout_s and holds it
    through the first step; then every group holds comm.train_timeout_s (runner/loop.py sets it)."""
    from engram.config import config_from_dict
    from recipes import train as recipe
    from runner import loop
    from tests.small_job import small_job

    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork (a hang)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    before: list[list[float]] = []
    set_timeouts = loop.set_pg_timeouts

    def spy(timeout_s: float) -> int:
        before.append(_pg_timeouts())
        return set_timeouts(timeout_s)

    loop.set_pg_timeouts = spy
    comm = {"comm": {"init_timeout_s": 1234, "train_timeout_s": 567}}
    cfg = config_from_dict(small_job(tmp, "comm", 1, 3, comm))
    try:
        recipe.train(cfg)
        assert before == [[1234.0]], before  # once, after the first step
        assert _pg_timeouts() == [567.0]
    finally:
        destroy_distributed()


def test_comm_timeouts_reach_the_process_group(tmp_path: Path) -> None:
    run_forked(_check_recipe_timeouts, str(tmp_path))


def _set_timeouts_on_subgroups(rank: int, world_size: int) -> list[float]:
    dist.new_group([0, 1])  # created without a timeout: torch's 30 min default
    assert set_pg_timeouts(42) == 2
    return _pg_timeouts()


@pytest.mark.slow
def test_train_timeout_reaches_every_gloo_group() -> None:
    assert run_distributed(_set_timeouts_on_subgroups, 2) == [[42.0, 42.0]] * 2


# --- Ascend settings (stand-in NPU, forked: they change os.environ and torch.random) ------------

ASCEND_VARS = (
    "HCCL_DETERMINISTIC",
    "CLOSE_MATMUL_K_SHIFT",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
    "PYTORCH_NPU_ALLOC_CONF",
)


class _PGStarted(Exception):
    pass


def _check_env_before_process_group(fake_dir: str, user_exec_timeout: str | None) -> None:
    """recipes/train.py with job.device=npu: the variables are in place when the process group
    is created (init_process_group is stopped there: no HCCL here), and the group gets the
    longer [comm] timeout (hccl cannot change it after the first step)."""
    sys.path.insert(0, fake_dir)
    for var in ASCEND_VARS:
        os.environ.pop(var, None)
    if user_exec_timeout is not None:
        os.environ["HCCL_EXEC_TIMEOUT"] = user_exec_timeout  # the user's value wins
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    seen: dict[str, Any] = {}

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        seen.update({var: os.environ.get(var) for var in ASCEND_VARS})
        seen["timeout_s"] = kwargs["timeout"].total_seconds()
        raise _PGStarted

    dist.init_process_group = init_process_group
    from engram.config import config_from_dict
    from recipes.train import train

    comm = {"init_timeout_s": 1000, "train_timeout_s": 2000}
    cfg = config_from_dict({"job": {"device": "npu", "deterministic": True}, "comm": comm})
    try:
        train(cfg)
    except _PGStarted:
        pass
    else:
        raise AssertionError("train() did not reach init_process_group")
    assert seen == {
        "HCCL_DETERMINISTIC": "true",
        "CLOSE_MATMUL_K_SHIFT": "1",
        "HCCL_CONNECT_TIMEOUT": device.NPU_ENV_DEFAULTS["HCCL_CONNECT_TIMEOUT"],
        "HCCL_EXEC_TIMEOUT": user_exec_timeout or "2000",  # else max of the [comm] timeouts
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        "timeout_s": 2000.0,
    }, seen


@pytest.mark.parametrize("user_exec_timeout", [None, "999"])
def test_ascend_env_is_set_before_process_group_init(
    fake_npu_dir: str, user_exec_timeout: str | None
) -> None:
    run_forked(_check_env_before_process_group, fake_npu_dir, user_exec_timeout)


def _check_compile_refused_when_auto_is_npu(fake_dir: str) -> None:
    """job.device = auto that resolves to the (stand-in) NPU: compile is refused at start-up,
    before any process group, naming the reason and the opt-in."""
    sys.path.insert(0, fake_dir)
    from engram.config import ConfigError, config_from_dict
    from recipes.train import train

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the process group was created before compile was refused")

    dist.init_process_group = init_process_group
    cfg = config_from_dict({"compile": {"enable": True}})  # job.device = auto
    try:
        train(cfg)
    except ConfigError as e:
        assert "triton-lang/triton-ascend#424" in str(e) and "allow_on_npu" in str(e), e
    else:
        raise AssertionError("compile on npu was not refused")


def test_compile_on_npu_refused_at_start_up(fake_npu_dir: str) -> None:
    run_forked(_check_compile_refused_when_auto_is_npu, fake_npu_dir)


def _check_npu_settings_only_on_npu(fake_dir: str) -> None:
    sys.path.insert(0, fake_dir)
    for var in ASCEND_VARS:
        os.environ.pop(var, None)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        os.environ.pop(var, None)
    original = torch.random.fork_rng
    assert device.apply_device_env("cpu", deterministic=True) == {}
    # cuda: only the allocator default, and not over torch's device-neutral name
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:False"
    assert device.apply_device_env("cuda", deterministic=True) == {}
    del os.environ["PYTORCH_ALLOC_CONF"]
    cuda = device.apply_device_env("cuda", deterministic=True)
    assert cuda == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, cuda
    assert device.describe_env("cuda", {}) == (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (yours)"
    )
    for device_type in ("cpu", "cuda"):
        assert device.patch_fork_rng(device_type) is False
        assert device.warn_npu_gaps(device_type, tp=2) is None
    assert not any(var in os.environ for var in ASCEND_VARS)
    assert torch.random.fork_rng is original

    device.import_device_backend("npu")
    applied = device.apply_device_env("npu", deterministic=False)
    assert "HCCL_DETERMINISTIC" not in applied and "HCCL_DETERMINISTIC" not in os.environ
    assert applied["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    line = device.describe_env("npu", applied)
    assert "HCCL_EXEC_TIMEOUT=3600 (default)" in line and "HCCL_DETERMINISTIC" not in line, line
    # fork_rng without a device type now forks the NPU generator (pipelining's call)...
    assert torch.random.fork_rng is not original
    torch.npu.calls.clear()
    with torch.random.fork_rng(devices=[0]):
        pass
    assert torch.npu.calls == [("get_rng_state", 0), ("set_rng_state", 0)], torch.npu.calls
    # ... an explicit device type is kept, and patching twice wraps once.
    patched = torch.random.fork_rng
    assert device.patch_fork_rng("npu") and torch.random.fork_rng is patched
    torch.npu.calls.clear()
    with torch.random.fork_rng(devices=[], device_type="cpu"):
        pass
    assert torch.npu.calls == []
    assert "scripts/check_cluster.py --tp" in device.warn_npu_gaps("npu", tp=2)
    assert device.warn_npu_gaps("npu", tp=1) is None


def test_npu_settings_and_fork_rng_fix_only_on_npu(fake_npu_dir: str) -> None:
    run_forked(_check_npu_settings_only_on_npu, fake_npu_dir)


def test_ascend_env_after_process_group_is_an_error(fake_npu_dir: str) -> None:
    def check(fake_dir: str) -> None:
        sys.path.insert(0, fake_dir)
        init_distributed("cpu", timeout_s=60)
        try:
            device.apply_device_env("npu")
        except RuntimeError as e:
            assert "before init_distributed" in str(e), e
        else:
            raise AssertionError("apply_device_env after the process group did not raise")
        finally:
            destroy_distributed()

    run_forked(check, fake_npu_dir)


def _check_memory_snapshot(fake_dir: str, run_folder: str) -> None:
    sys.path.insert(0, fake_dir)
    from engram.config import Profiling
    from engram.train.profiling import maybe_profile

    device.import_device_backend("npu")
    cfg = Profiling(memory_snapshot=True)
    try:
        with maybe_profile(cfg, Path(run_folder), rank=3, device_type="npu") as prof:
            prof.step()
            raise torch.OutOfMemoryError("NPU out of memory (stand-in)")
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("the out-of-memory error was swallowed")
    snapshot = Path(run_folder) / "memory_snapshot" / "rank3_oom.pickle"
    assert snapshot.read_bytes() == b"snapshot"
    assert torch.npu.calls == [("history", "all"), ("history", None)], torch.npu.calls
    # No OOM: recording stops, nothing is written.
    torch.npu.calls.clear()
    snapshot.unlink()
    with maybe_profile(cfg, Path(run_folder), rank=3, device_type="npu") as prof:
        prof.step()
    assert not snapshot.exists()
    assert torch.npu.calls == [("history", "all"), ("history", None)]


def test_memory_snapshot_on_oom_npu(fake_npu_dir: str, tmp_path: Path) -> None:
    run_forked(_check_memory_snapshot, fake_npu_dir, str(tmp_path))


def test_memory_snapshot_ignored_on_cpu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from engram.config import Profiling
    from engram.train.profiling import maybe_profile

    with pytest.raises(torch.OutOfMemoryError):
        with maybe_profile(Profiling(memory_snapshot=True), tmp_path, 0, device_type="cpu"):
            raise torch.OutOfMemoryError("cpu")
    assert "memory_snapshot needs a cuda or npu device" in caplog.text
    assert not (tmp_path / "memory_snapshot").exists()
