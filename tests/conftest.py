"""Shared test machinery: where a new test's processes and reference runs come from.

- Multi-process tests call `launcher.run_distributed(fn, world, *args)`: `fn(rank, world, *args)`
  runs on `world` forked gloo ranks. Those come from a pool kept per world size
  (tests/rank_pool.py), which puts state back between calls; pass `fresh=True` for a function
  that must start in a new process (it destroys the default group, kills itself, counts
  threads or process groups). A test that monkeypatches this process gets fresh ranks by itself.
  A function passed to a pool must be importable (module level) and its arguments picklable;
  other calls fork fresh ranks. `launcher.run_isolated` always forks.
- A reference run that other tests compute too (a one-process run, a layout trained with the
  same config) goes through `shared_runs.shared_run(fn, world, raw)`: once per session and
  config ([job] dump_folder / run_name aside); never for a run whose folder is read afterwards.
- The debug job: `small_job.small_job(...)`; build on it rather than on a private config.
- The README runs the suite in two pytest-xdist workers, a file per worker at a time (`-n 2
  --dist loadfile`): a test must not rely on another file's run having happened in its process,
  and asks `launcher.free_port()` for a port (each worker has its own block). A call of more
  ranks than the machine has cores waits while the other worker runs one (launcher.py).
- Every process launch is counted (launcher.count_launches) and the total is printed at the end
  of the run with how many shared runs were reused and why rank pools retired.
- A process of this session (this one, its forked and pooled ranks) times the CPU's GEMM peak,
  the divisor of the logged `mfu_indicative`, once per GEMM shape and dtype
  (`_gemm_peak_timed_once`), not at every train(): no test here reads that figure, and each
  timing busy-loops a core for 0.25 s. Subprocesses (run_train.sh) time it as users' runs do.
"""

import logging
import os
from collections import Counter

import launcher
import pytest
from launcher import LAUNCHES, count_launches
from rank_pool import RETIRED
from shared_runs import STATS

# torch_npu (or any other out-of-tree backend) must never be auto-imported in tests.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


@pytest.fixture(autouse=True)
def _engram_logs_reach_caplog():
    """An in-process train() runs init_logging, which stops propagation and writes to the stdout
    of the test that ran it; later tests' caplog needs the records to propagate again."""
    from engram.runtime.logs import LOGGERS

    for name in LOGGERS:
        log = logging.getLogger(name)
        for h in list(log.handlers):
            log.removeHandler(h)
        log.propagate = True
        log.setLevel(logging.NOTSET)
    yield


@pytest.fixture(autouse=True)
def _pooled_ranks_see_no_patches(request):
    """Pooled ranks (tests/rank_pool.py) were forked before this test: while it has monkeypatched
    anything here, or reads the ranks' output through capfd, run_distributed and run_isolated fork
    fresh processes, which inherit the patches and the captured file descriptors."""
    names = request.fixturenames
    if "capfd" in names or "capfdbinary" in names:
        launcher.parent_patched = lambda: True
    elif "monkeypatch" in names:
        mp = request.getfixturevalue("monkeypatch")
        launcher.parent_patched = lambda: bool(
            mp._setattr or mp._setitem or mp._savesyspath is not None or mp._cwd is not None
        )
    yield
    launcher.parent_patched = lambda: False


def _gemm_peak_timed_once() -> None:
    """device_specs.measure_gemm_tflops, memoised per process (see the module docstring); forks
    inherit the memo as it stands, and a test's monkeypatch of it still applies."""
    from engram.runtime import device_specs

    measure, memo = device_specs.measure_gemm_tflops, {}

    def timed_once(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in memo:
            memo[key] = measure(*args, **kwargs)
        return memo[key]

    device_specs.measure_gemm_tflops = timed_once


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Workers share the cores: one intra-op thread each, as the forked ranks use.
        import torch

        torch.set_num_threads(1)
    count_launches()
    _gemm_peak_timed_once()


# Under pytest-xdist (README's command: -n 2) the tests run in worker processes: each sends its
# counts to the controller at the end, which adds them up for the summary below.
_FROM_WORKERS: dict[str, Counter] = {
    "launches": Counter(),
    "shared": Counter(),
    "retired": Counter(),
}


def pytest_collection_modifyitems(items):
    """Files with the most `slow` tests first (each file's tests in their order): under xdist's
    --dist loadfile a worker takes a whole file, and a long file picked up last would run alone
    at the end."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (-slow[item.path], first[item.path]))


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["launches"], out["shared"], out["retired"] = dict(LAUNCHES), dict(STATS), dict(RETIRED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for key, got in getattr(node, "workeroutput", {}).items():
        if key in _FROM_WORKERS:
            _FROM_WORKERS[key].update(got)


def pytest_terminal_summary(terminalreporter):
    """The number of processes this run launched (forked ranks, other forks, subprocesses): the
    suite's cost is mostly launches, so the count is kept in sight."""
    launches = LAUNCHES + _FROM_WORKERS["launches"]
    shared = Counter(STATS) + _FROM_WORKERS["shared"]
    retired = RETIRED + _FROM_WORKERS["retired"]
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(launches.items()))
    terminalreporter.write_sep("=", f"process launches: {sum(launches.values())} ({kinds})")
    terminalreporter.write_line(
        f"shared runs: {shared['computed']} computed, {shared['shared']} reused "
        "(tests/shared_runs.py)"
    )
    if retired:
        why = ", ".join(f"{k} {n}" for k, n in retired.most_common())
        terminalreporter.write_line(f"rank pools retired: {why}")
