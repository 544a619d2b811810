"""engram/train/throughput.py and the peak table of engram/runtime/device_specs.py: the peak a
run's MFU divides by (override, table, measured), the per-step keys, and the start-up memory
warning on a stand-in NPU (tests/test_runtime_device.py's torch_npu, plus mem_get_info and a
device name). The keys in a real run's metrics.jsonl: tests/test_recipes_e2e.py (train.py) and
tests/test_parallelisms_deepspeed.py (train_deepspeed.py, with metrics.peak_tflops set)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from engram.config import ConfigError, Metrics
from engram.runtime.device_specs import PEAK_SPECS, peak_spec_for, resolve_peak
from engram.train.flops import FlopCount
from engram.train.throughput import Throughput
from tests.test_runtime_device import FAKE_TORCH_NPU, run_forked

GIB = 1 << 30

# What torch_npu also has and the device-layer stand-in leaves out.
MEMORY_INFO = """
npu.free = npu.total
npu.mem_get_info = lambda d=None: (npu.free, npu.total)
npu.get_device_name = lambda d=None: "Ascend910B2"
npu.memory_stats = lambda d=None: {"active_bytes.all.peak": npu.active}
npu.active = 0
"""


@pytest.fixture
def npu_dir(tmp_path: Path) -> str:
    (tmp_path / "torch_npu.py").write_text(FAKE_TORCH_NPU + MEMORY_INFO)
    return str(tmp_path)


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Ascend910B2", 354.0),
        ("Ascend910_9391", 354.0),
    ],
)
def test_peak_table_matches_the_device_name(name: str, tflops: float) -> None:
    spec = peak_spec_for(name)
    assert spec is not None and spec.bf16_tflops == tflops and spec.source
    peak = resolve_peak("cuda" if "NVIDIA" in name else "npu", name)
    assert (peak.tflops, peak.source) == (tflops, "table")


def test_every_peak_entry_states_its_source() -> None:
    assert all(s.source and s.bf16_tflops > 0 for s in PEAK_SPECS)
    assert peak_spec_for("Some Future Accelerator") is None


def test_override_beats_the_table_and_the_measurement() -> None:
    assert resolve_peak("cuda", "NVIDIA H100", 500.0).source == "config"
    assert resolve_peak("cpu", "cpu", 0.25).tflops == 0.25


def test_cpu_peak_is_measured_quickly_and_leaves_the_rng_alone() -> None:
    rng = torch.get_rng_state()
    t0 = time.perf_counter()
    peak = resolve_peak("cpu", "cpu")
    assert torch.equal(torch.get_rng_state(), rng)  # a run's losses stay bit-identical
    assert time.perf_counter() - t0 < 2.0  # a few hundred ms, with slack for a loaded machine
    assert peak.source == "measured" and peak.tflops > 0 and "GEMM" in peak.describe()


def test_peak_tflops_must_be_finite_and_not_negative() -> None:
    with pytest.raises(ConfigError, match="metrics.peak_tflops must be >= 0"):
        Metrics(peak_tflops=-1.0)
    with pytest.raises(ConfigError, match="finite"):
        Metrics(peak_tflops=float("inf"))


def test_window_metrics_on_cpu() -> None:
    flops = FlopCount(128, trained_params=10**6, frozen_params=0, forward_only_params=0,
                      attention=0, engram_gate=0)  # fmt: skip
    tp = Throughput(flops, torch.device("cpu"), world_size=2, peak_tflops=0.5)
    with tp.data_timer():
        time.sleep(0.02)
    m = tp.metrics(tokens_per_s=1000.0, step_time_s=0.2, steps=2)
    assert m["tflops"] == pytest.approx(6e6 * 1000 / 2 / 1e12)
    assert m["mfu"] == pytest.approx(100 * m["tflops"] / 0.5)
    assert m["data_time_s"] == pytest.approx(0.01, abs=0.01) and 0 < m["data_pct"] < 50
    # cpu: both memory figures are the process's peak resident set, % of the host's memory
    assert m["max_active_gib"] == m["max_reserved_gib"] > 0 and 0 < m["max_active_pct"] < 100
    assert tp.metrics(1000.0, 0.2, 1)["data_time_s"] == 0.0  # the next window starts at zero


def test_measured_peak_is_indicative_and_remeasured_when_exceeded(monkeypatch) -> None:
    """A CPU peak timed at start on a busy machine reads low (here 0.001 TFLOP/s): the window
    that runs above it re-measures the GEMM under the step's load, and the figure is logged as
    mfu_indicative, never as a real MFU over 100%."""
    from engram.runtime import device_specs

    timings = iter([0.001, 1.0])  # at start (busy), then again in the step's conditions
    monkeypatch.setattr(device_specs, "measure_gemm_tflops", lambda *a, **k: next(timings))
    flops = FlopCount(128, trained_params=10**6, frozen_params=0, forward_only_params=0,
                      attention=0, engram_gate=0)  # fmt: skip
    tp = Throughput(flops, torch.device("cpu"), world_size=1)
    assert tp.peak.source == "measured" and tp.peak.tflops == 0.001
    m = tp.metrics(tokens_per_s=1e5, step_time_s=0.2, steps=1)  # 0.6 TFLOP/s
    assert "mfu" not in m
    assert m["mfu_indicative"] == pytest.approx(60.0)  # against the re-measured 1.0
    assert tp.peak.tflops == 1.0 and "re-measured" in tp.peak.detail
    # A table / config peak is a real MFU, under its own key.
    assert "mfu" in Throughput(flops, torch.device("cpu"), 1, peak_tflops=2.0).metrics(1e5, 0.2, 1)


def _check_npu_memory_and_peak(fake_dir: str) -> None:
    sys.path.insert(0, fake_dir)
    from engram.runtime import device as dev
    from engram.train.throughput import log_device_memory

    dev.import_device_backend("npu")
    npu, where = torch.npu, torch.device("npu", 0)
    npu.total = int(60.97 * GIB)  # what a "64 GB" Atlas A2 reports
    npu.free = 40 * GIB  # another process holds ~21 GiB
    msg = log_device_memory(where)
    assert msg is not None
    for part in ("npu:0", "Ascend910B2", "free memory 40.00 GiB", "60.97 GiB", "DEVICE_SPECS"):
        assert part in msg, msg
    npu.free = int(60.5 * GIB)  # only the runtime's own context: no warning
    assert log_device_memory(where) is None

    flops = FlopCount(4096, 10**9, 0, 0, 0, 0)
    tp = Throughput(flops, where, world_size=8)
    assert (tp.peak.tflops, tp.peak.source) == (354.0, "table")
    npu.active, npu.reserved = 30 * GIB, 45 * GIB
    m = tp.metrics(tokens_per_s=8 * 1000.0, step_time_s=1.0, steps=1)
    assert m["tflops"] == pytest.approx(6e9 * 1000 / 1e12)
    assert m["mfu"] == pytest.approx(100 * 6.0 / 354.0)
    assert m["max_active_gib"] == pytest.approx(30.0)
    assert m["max_reserved_pct"] == pytest.approx(100 * 45 / 60.97, rel=1e-6)
    assert Throughput(flops, where, 8, peak_tflops=280.0).peak.source == "config"


def test_npu_free_memory_warning_and_table_peak(npu_dir: str) -> None:
    run_forked(_check_npu_memory_and_peak, npu_dir)
