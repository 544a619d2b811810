"""Throughput accounting both recipes log: TFLOP/s and MFU per device, device memory against what
the device can use, and the time a step waits for its batch; plus the start-up memory log.

The per-log-step keys (docs/architecture.md, "Throughput metrics"):

    tflops            model FLOPs per token (engram/train/flops.py) x tokens per second per
                      device / 1e12 (tokens_per_s / world size: every rank of a TP / PP / CP
                      group shares its tokens, as torchtitan divides by the non-data-parallel size)
    mfu               100 x tflops / the peak (engram/runtime/device_specs.py resolve_peak): a
                      table's or metrics.peak_tflops' figure
    mfu_indicative    instead of mfu when the peak is a GEMM measured on this machine (cpu, a
                      device the table lacks): it moves with the machine's load, so it is a
                      hint, not a utilisation. A window that runs above the peak re-measures it
                      then (up to MAX_REMEASURES times), in the step's own conditions, and keeps
                      the higher figure
    max_active_gib    peak of live tensors since the loop started (accelerators), the
                      process's peak resident set on cpu
    max_reserved_gib  peak of the allocator's reserved segments (cpu: the resident set again)
    max_active_pct / max_reserved_pct   of the memory the device reports (cpu: the host's)
    data_time_s       seconds per step spent waiting for the step's batches (mean over the window)
    data_pct          its share of step_time_s, in %
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engram.runtime import device as dev
from engram.runtime import device_specs
from engram.runtime.device_specs import Peak, resolve_memory, resolve_peak
from engram.train.flops import FlopCount
from engram.train.metrics import logger

GIB = float(1 << 30)
# The runtime's own context (CANN / CUDA) takes a few hundred MiB of every device before the
# first tensor: free memory below the usable figure by less than this is normal.
FREE_MEMORY_SLACK_GIB = 1.0
# A measured peak is timed again at most this often (~0.25 s each): a step whose GEMMs beat the
# small timing GEMM would otherwise re-time it every window.
MAX_REMEASURES = 3


def log_device_memory(device: torch.device) -> str | None:
    """Log the device's total and free memory (mem_get_info) and the usable figure the run goes
    by, with where it came from (device_specs.resolve_memory: the device's own total; the
    table's entry for its name, or its type's figure with a warning naming the fix). Warn,
    naming the device, when free memory is below it (by more than the runtime's own context).
    Returns the warning (None when there is none). Call before the model is placed."""
    info = dev.mem_get_info(device)
    if info is None:
        host = dev.host_memory_bytes() / GIB
        logger.info(f"device memory: {device} reports no mem_get_info; host memory {host:.1f} GiB")
        return None
    free, total = (x / GIB for x in info)
    name = dev.device_name(device)
    figure = resolve_memory(device.type, name, total)
    assert figure is not None  # a device total is there
    logger.info(f"device memory {device} ({name}): free {free:.2f} GiB; {figure.describe()}")
    if figure.warning:
        logger.warning(figure.warning)
    usable = figure.usable_gib
    if free >= usable - FREE_MEMORY_SLACK_GIB:
        return None
    msg = (
        f"{device} ({name}): free memory {free:.2f} GiB is below its {usable:.2f} GiB total "
        f"(mem_get_info; device_specs.DEVICE_SPECS / PEAK_SPECS give the planner's budget): "
        f"another process holds {total - free:.2f} GiB of this device (check npu-smi info / "
        f"nvidia-smi), or the device is smaller; plan with --device_memory_gib {free:.0f}"
    )
    logger.warning(msg)
    return msg


class Throughput:
    """The model's FLOPs per token and the device's peak, fixed at start; per log step the
    throughput metrics of the window (see the module docstring)."""

    def __init__(
        self, flops: FlopCount, device: torch.device, world_size: int, peak_tflops: float = 0.0
    ) -> None:
        self.flops, self.device, self.world_size = flops, device, world_size
        self.peak = resolve_peak(device.type, dev.device_name(device), peak_tflops)
        self.data_s = 0.0  # waiting for batches, this window
        # A GEMM timed once at start reads low when other jobs share the cores, and every
        # later MFU then reads high (over 100%): such a figure is logged as indicative only.
        self.mfu_key = "mfu_indicative" if self._measured else "mfu"
        self.remeasures_left = MAX_REMEASURES
        logger.info(self.flops.describe())
        note = " (mfu_indicative: a measured peak moves with the load)" if self._measured else ""
        logger.info(f"MFU against {self.peak.describe()}{note}")

    @property
    def _measured(self) -> bool:
        return self.peak.source == "measured"

    def _remeasure_peak(self, tflops: float) -> None:
        """The window ran above the measured peak: time the GEMM again now, under the load the
        step just saw, and keep the higher figure."""
        dtype = self.peak.gemm_dtype  # the GEMM resolve_peak timed at start
        again = device_specs.measure_gemm_tflops(self.device, dtype)
        if again > self.peak.tflops:
            self.peak = Peak(again, "measured", f"{self.peak.detail}, re-measured", dtype)
        logger.info(
            f"the step ran at {tflops:.3g} TFLOP/s, above the GEMM peak measured at start: "
            f"re-measured, MFU now against {self.peak.describe()}"
        )

    @contextmanager
    def data_timer(self) -> Iterator[None]:
        """Around the step's wait for its batches."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.data_s += time.perf_counter() - t0

    def metrics(self, tokens_per_s: float, step_time_s: float, steps: int) -> dict[str, float]:
        """The window's keys: `tokens_per_s` global, `step_time_s` its mean, over `steps` steps.
        Starts the next window's data time."""
        tflops = self.flops.per_token * tokens_per_s / self.world_size / 1e12
        if self._measured and tflops > self.peak.tflops and self.remeasures_left > 0:
            self.remeasures_left -= 1
            self._remeasure_peak(tflops)
        active, reserved, usable = dev.peak_memory_bytes(self.device)
        data_time = self.data_s / max(steps, 1)
        self.data_s = 0.0
        return {
            "tflops": tflops,
            self.mfu_key: 100.0 * tflops / self.peak.tflops,
            "max_active_gib": active / GIB,
            "max_active_pct": 100.0 * active / usable,
            "max_reserved_gib": reserved / GIB,
            "max_reserved_pct": 100.0 * reserved / usable,
            "data_time_s": data_time,
            "data_pct": 100.0 * data_time / step_time_s,
        }
