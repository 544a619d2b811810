"""torch.profiler traces every `profile_freq` steps, viewable in TensorBoard or Perfetto.

Traces go to `<run_folder>/<traces_folder>/rank<k>/rank<k>.<step>.pt.trace.json` (Chrome trace
format; the name follows torch's tensorboard_trace_handler, so the TensorBoard profiler plugin
lists one worker per rank with one span per profiled step; https://ui.perfetto.dev opens them too).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from engram.config import Profiling

logger = logging.getLogger("engram")

_WARMUP = 3  # profiler warm-up steps before the recorded one (first-call overheads are excluded)
_ACTIVE = 1  # steps recorded per trace


class Stepper(Protocol):
    def step(self) -> None: ...


class _NoProfiler:
    def step(self) -> None:
        pass


def _default_device_type() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if sys.modules.get("torch_npu") is not None and torch.npu.is_available():
        return "npu"
    return "cpu"


def profile_schedule(profile_freq: int) -> tuple[int, int, int]:
    """(wait, warmup, active) so that one step in every `profile_freq` is recorded: the last
    one of each cycle (steps profile_freq, 2 * profile_freq, ... counting from 1)."""
    warmup = min(_WARMUP, profile_freq - _ACTIVE)
    return profile_freq - warmup - _ACTIVE, warmup, _ACTIVE


@contextlib.contextmanager
def maybe_profile(
    cfg: Profiling,
    run_folder: Path,
    rank: int,
    device_type: str | None = None,
    start_step: int = 0,
) -> Iterator[Stepper]:
    """Yield an object whose `.step()` is called once per training step.

    Disabled: a no-op. Enabled: torch.profiler with CPU activity, plus CUDA on cuda devices.
    `start_step` (the resumed step) keeps the cycle aligned with the global step number.
    With `profiling.memory_snapshot`, an out-of-memory error in the body also leaves an allocator
    snapshot in the run folder (cuda / npu).
    """
    device_type = device_type or _default_device_type()
    with _memory_snapshot_on_oom(cfg, run_folder, rank, device_type):
        if not cfg.enable_profiling:
            yield _NoProfiler()
            return
        with _trace(cfg, run_folder, rank, device_type, start_step) as prof:
            yield prof


_SNAPSHOT_ENTRIES = 100_000  # allocator events kept (a ring buffer: the ones before the OOM)


@contextlib.contextmanager
def _memory_snapshot_on_oom(
    cfg: Profiling, run_folder: Path, rank: int, device_type: str
) -> Iterator[None]:
    """With `profiling.memory_snapshot` on cuda / npu: record allocator history; on an
    out-of-memory error write <run_folder>/memory_snapshot/rank<k>_oom.pickle and re-raise.
    torch_npu mirrors torch.cuda.memory's _record_memory_history / _dump_snapshot as
    torch.npu.memory (documented; not run on NPU hardware from this repository)."""
    if not cfg.memory_snapshot:
        yield
        return
    if device_type not in ("cuda", "npu"):
        logger.warning(
            "profiling.memory_snapshot needs a cuda or npu device; ignored on %s", device_type
        )
        yield
        return
    from engram.runtime.device import device_module

    memory = device_module(device_type).memory  # type: ignore[union-attr]
    memory._record_memory_history(max_entries=_SNAPSHOT_ENTRIES)
    try:
        yield
    except torch.OutOfMemoryError:
        path = Path(run_folder) / "memory_snapshot" / f"rank{rank}_oom.pickle"
        path.parent.mkdir(parents=True, exist_ok=True)
        memory._dump_snapshot(str(path))
        logger.error(
            "out of memory: allocator snapshot written to %s (open it on "
            "https://pytorch.org/memory_viz)",
            path,
        )
        raise
    finally:
        memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def _trace(
    cfg: Profiling, run_folder: Path, rank: int, device_type: str, start_step: int
) -> Iterator[Stepper]:
    trace_dir = Path(run_folder) / cfg.traces_folder / f"rank{rank}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    wait, warmup, active = profile_schedule(cfg.profile_freq)
    if rank == 0:
        logger.info("profiling every %d steps into %s", cfg.profile_freq, trace_dir.parent)

    if device_type == "npu":
        # Ascend: torch_npu.profiler mirrors torch.profiler (CPU + NPU activities, CANN data) and
        # writes its own folder layout for MindStudio Insight / the TensorBoard plugin.
        # Follows the torch_npu documentation; not run on NPU hardware from this repository.
        import torch_npu

        npu_prof = torch_npu.profiler
        prof: Any = npu_prof.profile(
            activities=[npu_prof.ProfilerActivity.CPU, npu_prof.ProfilerActivity.NPU],
            schedule=npu_prof.schedule(wait=wait, warmup=warmup, active=active),
            on_trace_ready=npu_prof.tensorboard_trace_handler(str(trace_dir)),
            record_shapes=True,
        )
    else:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)

        def on_trace_ready(p: torch.profiler.profile) -> None:
            begin = time.perf_counter()
            path = trace_dir / f"rank{rank}.{p.step_num}.pt.trace.json"
            p.export_chrome_trace(str(path))
            logger.info("wrote profiler trace %s in %.1f s", path, time.perf_counter() - begin)

        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active),
            on_trace_ready=on_trace_ready,
            record_shapes=True,
        )
    with prof:
        prof.step_num = start_step
        yield prof
