"""engram/runtime/device_specs.py: memory and dense bf16 / fp8 peaks per device model, matched by
the name the device reports (stand-in names here: no GPU / NPU on the test machine), the type
fallback with its warning, and the planner's --device."""

from __future__ import annotations

import argparse
import inspect

import pytest
from launcher import run_isolated

from engram.config import ConfigError
from engram.runtime.device_specs import (
    DEVICE_MODELS,
    DEVICE_SPECS,
    PEAK_SPECS,
    PLANNER_RESERVE_GIB,
    device_memory_gib,
    peak_spec_for,
    resolve_memory,
    usable_memory_gib,
)
from planner.cli import apply_device, main, parse_args
from planner.estimate import estimate
from planner.results import GIB


@pytest.mark.parametrize(
    ("reported", "key", "gib", "bf16", "fp8"),
    [
        ("NVIDIA H200", "h200", 139.8, 989.0, 1979.0),
        ("NVIDIA H100 80GB HBM3", "h100", 79.6, 989.0, 1979.0),
        ("NVIDIA H100 PCIe", "h100-pcie", 79.6, 756.0, 1513.0),
        ("NVIDIA H100 NVL", "h100-nvl", 93.6, 835.0, 1671.0),
        ("NVIDIA B200", "b200", 178.3, 2250.0, 4500.0),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb", 39.6, 312.0, None),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb", 79.6, 312.0, None),
        ("NVIDIA A100 80GB PCIe", "a100-80gb", 79.6, 312.0, None),
        ("Ascend910B2", "910b2", 61.0, 354.0, None),
        ("Ascend910B4", "910b4", 29.0, 354.0, None),
        ("Ascend910_9391", "910c", 61.0, 354.0, None),
    ],
)
def test_each_model_has_its_own_memory_and_peaks(reported, key, gib, bf16, fp8):
    spec = peak_spec_for(reported)
    assert spec is not None and spec.key == key
    assert (spec.usable_memory_gib, spec.bf16_tflops, spec.fp8_tflops) == (gib, bf16, fp8)
    assert spec.source and spec.memory_source and spec.nameplate
    assert device_memory_gib(key) == usable_memory_gib(key) == gib
    assert DEVICE_MODELS[key] is spec


def test_h200_is_not_budgeted_as_an_80_gb_gpu():
    """The first H200 run logged "79.60 GiB usable" (the cuda type figure) for 139.8 GiB."""
    assert device_memory_gib("h200") == 139.8 != device_memory_gib("cuda") == 79.6
    figure = resolve_memory("cuda", "NVIDIA H200")
    assert figure is not None and figure.usable_gib == 139.8
    assert figure.source == "table (name matched)" and figure.warning is None


def test_a_device_total_beats_the_table_and_says_what_matched():
    figure = resolve_memory("cuda", "NVIDIA H200", 139.81)
    assert figure is not None and figure.usable_gib == 139.81 and figure.source == "mem_get_info"
    assert "NVIDIA H200" in figure.describe() and "name matched" in figure.describe()
    # ~139 GiB less the planner's reserve, which its default --reserve_gib is
    assert figure.for_tensors_gib == pytest.approx(139.81 - PLANNER_RESERVE_GIB)
    assert "136.81 GiB for tensors" in figure.describe()
    default = inspect.signature(estimate).parameters["reserve_gib"].default
    assert default == PLANNER_RESERVE_GIB == parse_args(["--world_size", "1"])[0].reserve_gib


def test_unknown_name_falls_back_to_its_type_with_a_warning_naming_the_fix():
    figure = resolve_memory("cuda", "NVIDIA Future GPU")
    assert figure is not None and figure.usable_gib == DEVICE_SPECS["cuda"].usable_memory_gib
    assert figure.source == "table (type fallback)"
    assert figure.warning is not None
    for part in ("'NVIDIA Future GPU'", "PEAK_SPECS", "--device_memory_gib", "metrics.peak_tflops"):
        assert part in figure.warning
    assert resolve_memory("cpu", "cpu") is None


def test_every_entry_states_its_sources():
    assert all(s.source and s.bf16_tflops > 0 for s in PEAK_SPECS)
    for s in PEAK_SPECS:
        assert s.fp8_tflops is None or s.fp8_tflops > s.bf16_tflops
        assert s.usable_memory_gib is None or s.memory_source
        if s.device_type == "npu":
            assert s.fp8_tflops is None  # no float8 matmul on 910B / 910C


def test_planner_device_flag():
    """--device takes a model or a type: the budget (and --compare's peak) unless given."""
    opts = argparse.Namespace(device="H200", device_memory_gib=None, peak_tflops=None)
    apply_device(opts)
    assert (opts.device_memory_gib, opts.peak_tflops) == (139.8, 989.0)
    opts = argparse.Namespace(device="npu", device_memory_gib=50.0, peak_tflops=None)
    apply_device(opts)
    assert (opts.device_memory_gib, opts.peak_tflops) == (50.0, None)
    with pytest.raises(ConfigError, match="h200"):
        apply_device(argparse.Namespace(device="h300", device_memory_gib=None, peak_tflops=None))
    est = run_isolated(
        main,
        ["--job.config_file", "train_configs/debug_model.toml", "--world_size", "2", "--json"]
        + ["--ranks", "0", "--device", "b200"],
    )
    assert est.device_memory_bytes == int(178.3 * GIB)
