"""Fork-based multi-process launcher for gloo tests.

The parent imports torch once; each test forks `world_size` real processes that join a real gloo
process group over 127.0.0.1 (no mocked collectives). This costs ~1 s instead of ~7 s per torchrun.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

# Process launches of this pytest process, by kind (printed at the end of the run by conftest).
# Counted where every launch goes through: multiprocessing's Process.start and subprocess.Popen.
LAUNCHES: Counter[str] = Counter()


def _launch_kind_of_process(proc: Any) -> str:
    target = getattr(proc, "_target", None)
    # tests import this module both as `launcher` and as `tests.launcher`
    module = getattr(target, "__module__", "").rsplit(".", 1)[-1]
    if module == "launcher":
        return "forked ranks"
    if module == "rank_pool":
        return "pooled ranks"
    return "other forks"


def _launch_kind_of_command(args: Any) -> str:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    head = os.path.basename(os.fsdecode(argv[0])).split()[0] if argv else ""
    if head.startswith("python") or head in ("torchrun", "deepspeed") or head.endswith(".sh"):
        return "python subprocesses"
    if os.fsdecode(argv[0]) == sys.executable:
        return "python subprocesses"
    return "tool subprocesses"


def count_launches() -> None:
    """Count every process this pytest process starts, in LAUNCHES (installed once by conftest).
    Launches made inside a forked rank are that rank's own and are not counted."""
    from multiprocessing.process import BaseProcess

    if getattr(BaseProcess.start, "_counted", False):
        return
    parent = os.getpid()
    start, popen_init = BaseProcess.start, subprocess.Popen.__init__

    def counted_start(self):
        if os.getpid() == parent:
            LAUNCHES[_launch_kind_of_process(self)] += 1
        return start(self)

    def counted_popen_init(self, args, *a, **kw):
        if os.getpid() == parent:
            LAUNCHES[_launch_kind_of_command(args)] += 1
        return popen_init(self, args, *a, **kw)

    counted_start._counted = True  # type: ignore[attr-defined]
    BaseProcess.start = counted_start  # type: ignore[method-assign]
    subprocess.Popen.__init__ = counted_popen_init  # type: ignore[method-assign]


# Under pytest-xdist each worker takes its ports from its own block below the kernel's ephemeral
# range (32768-60999 here), so no other worker's bind(0) or outgoing connection can be handed a
# port between free_port() and the rendezvous store binding it.
_PORT_BLOCK, _PORT_BASE, _PORT_WORKERS = 1500, 10000, 14
_next_port: dict[int, int] = {}


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    n = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else -1
    if not 0 <= n < _PORT_WORKERS:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    # a forked rank that asks for a port starts elsewhere in the block than its parent
    pid = os.getpid()
    start = _next_port.get(pid, (pid * 7919) % _PORT_BLOCK)
    for i in range(_PORT_BLOCK):
        offset = (start + i) % _PORT_BLOCK
        port = _PORT_BASE + n * _PORT_BLOCK + offset
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _next_port[pid] = offset + 1
        return port
    raise RuntimeError(f"no free port in {worker}'s block of {_PORT_BLOCK}")


# GC_FROZEN_AFTER_FORK: a forked or pooled process starts with gc.freeze(). What it inherits
# from pytest (~330k objects: torch, the test modules) is then never traversed again by its
# collections, which otherwise walk all of it at each full collection and at every pool call's
# gc.collect (0.2-0.9 s a call) and touch every object's header (copy-on-write page faults).
# Objects made after the fork are collected as usual.


def _to_picklable(obj: Any) -> Any:
    """Tensors cross the process boundary as numpy arrays (torch shares them by file descriptor,
    which breaks once the worker has exited)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _to_picklable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_picklable(v) for v in obj)
    return obj


def _worker(fn, rank, world_size, port, args, queue):
    gc.freeze()  # see GC_FROZEN_AFTER_FORK
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, _to_picklable(result)))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        remove_page_files()


def remove_page_files() -> None:
    """A forked worker ends by os._exit, which runs no atexit: delete the NVMe tables' page
    files here (each is as large as its shard)."""
    import sys

    nvme = sys.modules.get("parallelisms.engram_tables.nvme")
    if nvme is not None:
        nvme.remove_page_files()


# Set by conftest for the running test: True while it has monkeypatched anything in this (the
# parent) process, or captures file descriptors, which pooled ranks forked earlier would not see.
parent_patched: Callable[[], bool] = lambda: False  # noqa: E731


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    fresh: bool = False,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` forked gloo ranks; return results by rank.

    The ranks come from a pool kept per world size (tests/rank_pool.py: a joined process group,
    warm caches, state put back between calls) unless `fresh` is set, the test has monkeypatched
    this process, or fn / args do not pickle: then `world_size` new ranks are forked for this
    call. Use `fresh=True` for a function that needs a new process (it counts threads or
    process groups from zero, kills itself, relies on a cold cache). TEST_FRESH_RANKS=1 forks
    fresh ranks for every call (to tell a pooling problem from a test's own).

    Raises with the failing rank's traceback if any rank fails, and on timeout (a hang).
    """
    start = time.monotonic()
    try:
        with _one_wide_run_at_a_time(world_size):
            if not fresh and not parent_patched() and os.environ.get("TEST_FRESH_RANKS") != "1":
                from rank_pool import run_pooled

                pooled = run_pooled(fn, world_size, args, timeout)
                if pooled is not None:
                    return pooled
            return _run_forked(fn, world_size, args, timeout)
    finally:
        _log_call(fn, world_size, args, time.monotonic() - start)


@contextlib.contextmanager
def _one_wide_run_at_a_time(world_size: int) -> Iterator[None]:
    """Under pytest-xdist, a call of more ranks than this machine has cores waits while
    another worker runs one: two such calls at once only switch between 2 x world ranks on the
    same cores (gloo's threads included), the same work at more CPU time."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run or world_size <= (os.cpu_count() or 1):
        yield
        return
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), f"engram-tests-{run}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def in_turn(rank: int, world: int, fn: Callable[..., Any], configs: list[Any]) -> list[Any]:
    """`fn(rank, world, config)` for each config in turn, in the same ranks: several runs in one
    launch, `run_distributed(in_turn, world, fn, configs)` (fn module-level, so it pickles)."""
    return [fn(rank, world, config) for config in configs]


def _log_call(fn: Callable[..., Any], world_size: int, args: tuple, seconds: float) -> None:
    """TEST_RUN_LOG=FILE: one JSON line per call (test, function, world, seconds, config key),
    to find runs that several tests compute alike (candidates for shared_runs.shared_run)."""
    path = os.environ.get("TEST_RUN_LOG")
    if not path:
        return
    import hashlib
    import json

    from shared_runs import run_key

    raw = next((a for a in args if isinstance(a, dict) and "job" in a), None)
    key = run_key(fn, world_size, raw, args[1:]) if raw is not None and args[0] is raw else None
    line = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
        "fn": f"{fn.__module__}.{fn.__qualname__}",
        "world": world_size,
        "seconds": round(seconds, 2),
        "key": hashlib.sha1(key.encode()).hexdigest()[:12] if key else None,
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def _run_forked(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list[Any]:
    # DTensor and the profiler import torch._dynamo lazily (2-4 s); do it once before forking.
    import torch._dynamo  # noqa: F401

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise rank_failure(procs, errors)
    return [results[r] for r in range(world_size)]


def rank_failure(procs: list[Any], errors: list[str]) -> RuntimeError:
    """The error run_distributed raises when ranks failed (`errors`: their reports).

    A rank killed by a signal (a segfault in a collective) reports nothing itself; its peers
    then fail with "connection closed by peer". Name it first: that is where to look."""
    died = [
        f"rank {r} died with signal {signal.Signals(-p.exitcode).name} (its own stack, if "
        "any, is in the captured stderr: faulthandler)"
        for r, p in enumerate(procs)
        if p.exitcode is not None and p.exitcode < 0 and p.exitcode != -signal.SIGKILL
    ]
    return RuntimeError("\n".join(died + errors))


def _isolated_worker(fn, args, kwargs, queue):
    gc.freeze()  # see GC_FROZEN_AFTER_FORK
    import torch

    # The parent's OpenMP pool does not survive fork (libgomp): a multi-threaded op in the child
    # can wait forever on it. One thread, as the ranks of run_distributed use.
    torch.set_num_threads(1)
    try:
        queue.put((True, fn(*args, **kwargs)))
    except BaseException as e:  # re-raised in the parent
        queue.put((False, e))
    finally:
        remove_page_files()


def run_isolated(fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> Any:
    """Run `fn(*args, **kwargs)` in another process and return its result (or re-raise its
    exception). For code that leaves process-global torch.distributed state behind (a fake
    process group, DeviceMesh caches), which later forked ranks would otherwise inherit.

    The process is a pooled one without a process group (tests/rank_pool.py, which puts its
    state back after each call), on the same terms as run_distributed's ranks; else forked."""
    if not parent_patched() and os.environ.get("TEST_FRESH_RANKS") != "1":
        from rank_pool import ISOLATED, run_pooled

        pooled = run_pooled(fn, ISOLATED, args, timeout, kwargs)
        if pooled is not None:
            ((ok, payload),) = pooled
            if not ok:
                raise payload
            return payload
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_isolated_worker, args=(fn, args, kwargs, queue))
    proc.start()
    try:
        ok, payload = queue.get(timeout=timeout)
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    if not ok:
        raise payload
    return payload
