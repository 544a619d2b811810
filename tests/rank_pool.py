"""Persistent forked gloo ranks: one pool per world size runs successive test functions.

Forking fresh ranks for every call costs the fork of a large process, the gloo rendezvous, the
modules each child imports lazily (the test module itself among them) and the teardown. A pool
keeps `world` ranks with a joined default process group and hands each of them
`fn(rank, world, *args)` in turn (tests/launcher.py's run_distributed decides when).

Between two calls a rank puts back what a test may have changed: module and class attributes
that the call rebound (a rank function that patches the code it checks; see Bindings),
os.environ and the working directory (the parent's, sent with each call), signal handlers,
every process group but the default one (and DTensor's caches, which name them), the default
group's timeout, torch's default dtype, grad mode, determinism flag and thread count, dynamo's
caches and the NVMe page files. A call that fails, or that leaves the
default process group destroyed or a new thread running, retires the pool: the next call forks
new ranks. A pool also retires after MAX_CALLS calls, to bound what leaks past the reset.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

MAX_CALLS = 60
# Pools are kept for these world sizes (an 8-rank pool would hold 8 idle processes' memory).
POOLED_WORLDS = (1, 2, 4)
ISOLATED = 0  # the "world size" of run_isolated's pool: one process, no process group
_STOP = b"stop"  # what close() sends a waiting rank (a call is a pickle, never these bytes)
# Module and class attributes a rank function may rebind (tests patch the code they check inside
# the rank): the project's packages and the test modules fully, these torch modules' functions.
_PROJECT = ("engram", "parallelisms", "runner", "recipes", "planner", "scripts", "benchmarks")
_TORCH = ("torch", "torch.cuda", "torch.distributed", "torch.distributed.checkpoint", "logging")
# Threads that may stay between calls: they hold no test's state.
_IDLE_THREADS = ("tqdm_monitor",)
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
_DEFAULT_PG_TIMEOUT = timedelta(minutes=30)  # init_process_group's default for gloo


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
    }


def _patchable(name: str) -> bool:
    top = name.split(".")[0]
    return top in _PROJECT or top.startswith("test_") or name in _TORCH


class Loggers:
    """Every logger's handlers, level and propagation as at the start; `restore` puts them back
    (train() sets up the "engram" logger; a test may add a handler that collects records)."""

    def __init__(self) -> None:
        self.saved = {name: self._state(lg) for name, lg in self._loggers()}

    @staticmethod
    def _loggers() -> list:
        import logging

        items = list(logging.Logger.manager.loggerDict.items())
        return [
            ("", logging.getLogger()),
            *((n, lg) for n, lg in items if isinstance(lg, logging.Logger)),
        ]

    @staticmethod
    def _state(lg: Any) -> tuple:
        return list(lg.handlers), lg.level, lg.propagate, lg.disabled

    def restore(self) -> None:
        for name, lg in self._loggers():
            handlers, level, propagate, disabled = self.saved.get(name, ([], 0, True, False))
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled


class Bindings:
    """The attributes of the patchable modules (and of the project's classes) as they were when
    each module was first seen; `restore` rebinds whatever a call rebound since."""

    def __init__(self) -> None:
        self.saved: dict[tuple, tuple[Any, dict]] = {}

    def add_new_modules(self) -> None:
        for name, mod in list(sys.modules.items()):
            if mod is None or ("m", name) in self.saved or not _patchable(name):
                continue
            attrs = dict(vars(mod))
            self.saved[("m", name)] = (mod, attrs)
            if name in _TORCH:
                continue
            for value in attrs.values():
                if isinstance(value, type) and value.__module__ == name:
                    self.saved[("c", name, value.__qualname__)] = (value, dict(vars(value)))

    def restore(self) -> None:
        import types

        for key, (owner, attrs) in self.saved.items():
            now = vars(owner)
            if key[0] == "m" and key[1] not in _TORCH:  # e.g. a log-once cache: empty again
                for value in list(now.values()):
                    if callable(getattr(value, "cache_clear", None)) and hasattr(
                        value, "__wrapped__"
                    ):
                        value.cache_clear()
            for name, old in attrs.items():
                new = now.get(name, old)
                if new is old or isinstance(new, types.ModuleType):
                    continue
                if key[1] in _TORCH and not callable(old):
                    continue  # torch's own state (lazily set globals), not a patch
                setattr(owner, name, old)


def _put_back(torch: Any, dist: Any, signals: dict, threads: set, world: int) -> str:
    """Undo what a call may have changed; why this rank cannot serve another call, or ""."""
    gc.collect()  # FSDP's groups sit in reference cycles that hold process groups
    signal.alarm(0)
    for sig, handler in signals.items():
        signal.signal(sig, handler)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(1)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    from launcher import remove_page_files

    remove_page_files()
    comm = sys.modules.get("deepspeed.comm.comm")
    if getattr(comm, "cdb", None) is not None:  # DeepSpeed keeps its groups process-wide
        return "deepspeed initialised"
    if world == ISOLATED and dist.is_initialized():  # e.g. a fake group the call left behind
        dist.destroy_process_group()
    if world != ISOLATED and not dist.is_initialized():
        return "process group destroyed"
    # DTensor's sharding cache keys meshes by value and hands back the mesh (so its groups) of
    # the call that filled it: emptied before the groups it names go.
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's
    from torch.distributed.tensor import _redistribute

    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()
    c10d = dist.distributed_c10d
    if world != ISOLATED:
        default = c10d._get_default_group()
        for pg in list(c10d._world.pg_map):
            if pg is not default:
                dist.destroy_process_group(pg)
        c10d._set_pg_timeout(_DEFAULT_PG_TIMEOUT, None)
    _stop_host_worker()
    deadline = time.monotonic() + 2.0  # an executor collected above lets its threads go
    left = []
    for t in threading.enumerate():
        if t in threads or t.name.startswith(_IDLE_THREADS):
            continue
        t.join(timeout=max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            left.append(t.name)
    return f"threads left running: {', '.join(left)}" if left else ""


def _stop_host_worker() -> None:
    """The host-table worker is one per process and remembers a failed job (every later job
    fails): stopped between calls, the next call starts a new one, as a fresh process would."""
    for name, mod in list(sys.modules.items()):
        worker = getattr(mod, "HOST_WORKER", None) if name.endswith("host_worker") else None
        if worker is not None and worker._pool is not None:
            worker._pool.shutdown(wait=True)
            worker._pool, worker._pid, worker._pending, worker._failed = None, -1, [], None


def _call(fn: Any, rank: int, world: int, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """(True, result) or (False, what the parent raises from): a rank's traceback text, or
    run_isolated's exception itself."""
    from launcher import _to_picklable

    try:
        if world == ISOLATED:
            return True, fn(*args, **kwargs)
        return True, _to_picklable(fn(rank, world, *args))
    except BaseException as e:  # reported to the parent, which raises it
        if world != ISOLATED:
            return False, traceback.format_exc()
        try:
            pickle.dumps(e)
            return False, e
        except Exception:
            return False, RuntimeError(traceback.format_exc())


def _serve(rank: int, world: int, port: int, conn: Any, parent_end: Any) -> None:
    parent_end.close()
    gc.freeze()  # see launcher.GC_FROZEN_AFTER_FORK
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank_env = _rank_env(rank, world, port) if world != ISOLATED else {}
    os.environ.update(rank_env)
    if world != ISOLATED:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=_DEFAULT_PG_TIMEOUT)
    signals = {s: signal.getsignal(s) for s in _SIGNALS}
    threads = set(threading.enumerate())
    bindings, loggers = Bindings(), Loggers()
    try:
        while True:
            bindings.add_new_modules()
            try:
                payload = conn.recv_bytes()
            except EOFError:
                return
            if payload == _STOP:
                return
            fn, args, kwargs, env, cwd = pickle.loads(payload)
            bindings.add_new_modules()  # the test module the call came from
            os.environ.clear()
            os.environ.update(env)
            os.environ.update(rank_env)
            os.chdir(cwd)
            reply = _call(fn, rank, world, args, kwargs)
            sys.stdout.flush()  # a fresh process would flush at its exit
            sys.stderr.flush()
            try:
                bindings.restore()
                loggers.restore()
                # A failed rank may have left its peers inside a collective; an isolated call
                # that raised is an outcome (tests expect refusals), its state is put back.
                failed = not reply[0] and world != ISOLATED
                retire = "failed" if failed else _put_back(torch, dist, signals, threads, world)
            except BaseException as e:
                retire = f"put back failed: {e!r}"
            try:
                conn.send((*reply, retire))
            except (BrokenPipeError, ConnectionResetError):
                return  # the parent gave up on this pool (another rank failed first)
            if retire:
                return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        from launcher import remove_page_files

        remove_page_files()


class RankPool:
    """`world` forked ranks joined in one gloo group (or, for ISOLATED, one process without a
    process group), serving calls until retired."""

    def __init__(self, world: int) -> None:
        from launcher import free_port

        ctx = mp.get_context("fork")
        port = free_port()
        self.world, self.calls, self.conns, self.procs = world, 0, [], []
        for rank in range(max(world, 1)):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, port, theirs, ours))
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, payload: bytes, timeout: float) -> tuple[list[Any], bool]:
        """Results by rank and whether the pool may serve again; RuntimeError if a rank failed,
        TimeoutError on a hang (the pool is then closed)."""
        self.calls += 1
        for conn in self.conns:
            conn.send_bytes(payload)
        results: dict[int, Any] = {}
        errors: list[str] = []
        retire = ""
        pending = dict(enumerate(self.conns))
        isolated: list[tuple[bool, Any]] = []
        deadline = time.monotonic() + timeout
        while pending and not errors:
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close(kill=True)
                raise TimeoutError(f"{self.world} pooled ranks: no answer in {timeout:g} s (hang)")
            for rank in [r for r, c in pending.items() if c in ready]:
                conn = pending.pop(rank)
                try:
                    ok, payload_back, why = conn.recv()
                except EOFError:
                    errors.append(f"rank {rank} failed:\nits process ended without a result")
                    break
                retire = retire or why
                if self.world == ISOLATED:
                    isolated.append((ok, payload_back))
                elif ok:
                    results[rank] = payload_back
                else:
                    errors.append(f"rank {rank} failed:\n{payload_back}")
                    break
        if errors:
            from launcher import rank_failure

            self.close(kill=True)
            raise rank_failure(self.procs, errors)
        if not retire and self.calls >= MAX_CALLS:
            retire = f"served {MAX_CALLS} calls"
        if retire:
            RETIRED[retire[:120]] += 1
        if self.world == ISOLATED:
            return isolated, not retire
        return [results[r] for r in range(self.world)], not retire

    def close(self, kill: bool = False) -> None:
        for conn in self.conns:
            # Told to stop, not left to see EOF: every process forked since this pool (other
            # pools' ranks, forked ranks) holds a copy of this end, and the pipe reaches EOF
            # only once they have all closed it (a retiring pool waited out its 10 s join).
            try:
                conn.send_bytes(_STOP)
            except OSError:
                pass  # that rank is gone already
            conn.close()
        for proc in self.procs:
            proc.join(timeout=0.5 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


_POOLS: dict[int, RankPool] = {}
# Why pools retired (printed at the end of the run with the launch count).
RETIRED: Counter[str] = Counter()


def run_pooled(
    fn: Any, world: int, args: tuple, timeout: float, kwargs: dict | None = None
) -> list[Any] | None:
    """Results by rank (for ISOLATED: [(ok, result or exception)]), or None where a pool
    cannot take the call (that world size is not pooled, or fn/args do not pickle): the caller
    then forks fresh ranks."""
    if world not in (*POOLED_WORLDS, ISOLATED):
        return None
    try:
        payload = pickle.dumps((fn, args, kwargs or {}, dict(os.environ), os.getcwd()))
    except Exception:  # a local function or an unpicklable argument: fork fresh ranks
        return None
    pool = _POOLS.pop(world, None)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        pool = RankPool(world)
    try:
        results, reusable = pool.run(payload, timeout)
    except BaseException:  # a failed rank, a hang, or the run interrupted mid-call
        pool.close(kill=True)
        raise
    if reusable:
        _POOLS[world] = pool
    else:
        pool.close()
    return results


@atexit.register
def close_pools() -> None:
    """Before multiprocessing's own exit hook joins them (atexit runs hooks last-in first)."""
    while _POOLS:
        _POOLS.popitem()[1].close()
