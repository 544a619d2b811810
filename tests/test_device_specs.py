"""engram/runtime/device_specs.py: memory and dense bf16 / fp8 peaks per device model, matched by
the name the device reports (the real names users' machines report, each with where it was seen
and figures from sources other than the table), the type fallback with its warning, and the
planner's --device."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Seen:
    """A device as a user's machine reports it, with figures from sources other than the table."""

    name: str  # what torch.cuda / torch_npu .get_device_name() returns
    key: str  # the table entry it must pick (its planner key, or its marker)
    where: str  # where the name (and the reported total) was seen
    reported_gib: float | None  # the mem_get_info / OOM-message total seen there; None: derived
    smi_mib: int | None = None  # nvidia-smi / npu-smi total for the same model
    bf16_sparse: float | None = None  # vendor datasheet, with sparsity (the table is dense = /2)
    fp8_sparse: float | None = None
    halve: bool = True  # False where the datasheet's figure is already dense


# Datasheets: NVIDIA H100 (SXM 1,979 bf16 / 3,958 fp8; PCIe 1,513 / 3,026; NVL 1,671 / 3,341),
# H200 and GH200 (as H100 SXM), HGX B200 (4.5 / 9 PFLOPS per GPU), GB200 NVL72 (360 / 720 PFLOPS
# over 72 GPUs), A100 (624 bf16, no fp8), all with sparsity; L40S (362.05 dense: its sheet's
# 733 with sparsity is not twice that); AMD MI300X / MI325X
# (2,614.9 with sparsity). nvidia-smi totals: modal-labs/modal-client#2797 and
# thundergolfer.com/blog/nvidia-gpu-memory-capacity (H200 143,771 MiB); npu-smi: the issues named.
SEEN = (
    Seen("NVIDIA H100 80GB HBM3", "h100", "vllm-project/vllm#5847 (collect_env); total: "
         "vllm-project/vllm#27508", 79.11, 81559, 1979, 3958),
    Seen("NVIDIA H100", "h100", "ogx-ai/ogx#1798 (collect_env)", 79.11, 81559, 1979, 3958),
    Seen("NVIDIA H100 PCIe", "h100-pcie", "GPU-name tables in public code; total derived",
         None, 81559, 1513, 3026),
    Seen("NVIDIA H100 NVL", "h100-nvl", "fastfetch-cli/fastfetch#1658; total: ali-vilab/VACE#56",
         93.0, 95830, 1671, 3341),
    Seen("NVIDIA H200", "h200", "NVIDIA/mig-parted#120 (nvidia-smi Product Name); total: this "
         "project's H200 run", 139.8, 143771, 1979, 3958),
    Seen("NVIDIA GH200 480GB", "gh200", "Grace Hopper nodes' nvidia-smi / torch name (96 GB "
         "HBM3 part); total: Lightning-AI/litgpt#1892", 94.88, 97871, 1979, 3958),
    Seen("NVIDIA GH200 144G HBM3e", "gh200-144g", "NVIDIA/mig-parted#139; total derived", None,
         None, 1979, 3958),
    Seen("NVIDIA H800", "H800", "GPU-name checks in public code", None, None, 1979, 3958),
    Seen("NVIDIA H20", "H20", "sgl-project/sglang#25225", None),
    Seen("NVIDIA B200", "b200", "pytorch/ao#4002 (device query)", 178.35, None, 4500, 9000),
    Seen("NVIDIA GB200", "gb200", "sgl-project/sglang#11208, vllm-project/vllm#45670 "
         "(collect_env); total derived", None, None, 5000, 10000),
    Seen("NVIDIA A100-SXM4-40GB", "a100-40gb", "bottlerocket-os/bottlerocket#3873 (deviceQuery, "
         "42,298,834,944 bytes)", 39.39, 40960, 624),
    Seen("NVIDIA A100-PCIE-40GB", "A100-PCIE-40GB", "the 40 GB PCIe card's name; total derived",
         None, 40960, 624),
    Seen("NVIDIA A100-SXM4-80GB", "a100-80gb", "vllm-project/vllm#10026; total: "
         "lianqi1008/Control-GIC#6", 79.14, 81920, 624),
    Seen("NVIDIA A100 80GB PCIe", "a100-80gb", "vllm-project/vllm#4608 (nvtop)", 79.14, 81920, 624),
    Seen("NVIDIA A800-SXM4-80GB", "A800", "the A100's China variant, named as the A100", None,
         None, 624),
    Seen("NVIDIA L40S", "L40S", "modal-labs/modal-client#2797", None, 46068, 362.05, halve=False),
    Seen("AMD Instinct MI300X", "MI300X", "rocm-smi / torch name on ROCm", None, None, 2614.9),
    Seen("AMD Instinct MI325X", "MI325X", "rocm-smi / torch name on ROCm", None, None, 2614.9),
    Seen("Ascend910B1", "910b1", "torch_npu SoC name (vllm-ascend device-type map)", 60.96),
    Seen("Ascend910B2", "910b2", "vllm-project/vllm-ascend#1127 (910B2, 64GB); total: "
         "vllm-project/vllm-ascend#1670", 60.96),
    Seen("Ascend910B2C", "910b2", "torch_npu SoC name (vllm-ascend device-type map)", 60.96),
    Seen("Ascend910B3", "910b3", "torch_npu SoC name (vllm-ascend device-type map)", 60.96),
    Seen("Ascend910B4", "910b4", "vllm-project/vllm-ascend#8746 (npu-smi 32,768 MB); total "
         "derived", None, 32768),
    Seen("Ascend910B4-1", "910b4-1", "Project-HAMi/HAMi-WebUI#47 (npu-smi 65,536 MB); total "
         "derived", None, 65536),
    Seen("Ascend910_9391", "910c", "torch_npu SoC name of an A3 die; total: "
         "sgl-project/sglang#29838", 61.27),
    Seen("Ascend910_9382", "910c", "torch_npu SoC name of an A3 die", 61.27),
)  # fmt: skip
# The family entry no real name reaches while every 910B bin has its own: the planner's --device 910b.
KEY_ONLY = {"910b"}


def _entry(key: str):
    return DEVICE_MODELS.get(key) or next(s for s in PEAK_SPECS if s.marker == key)


@pytest.mark.parametrize("seen", SEEN, ids=[s.name for s in SEEN])
def test_each_real_device_name_picks_its_entry_with_figures_from_other_sources(seen: Seen):
    spec = peak_spec_for(seen.name)
    assert spec is _entry(seen.key), (seen.name, spec)
    if seen.reported_gib is not None:  # the total a user saw on that model
        assert spec.usable_memory_gib == seen.reported_gib
        assert device_memory_gib(spec.key or "cuda") == usable_memory_gib(spec.key or "cuda")
    elif spec.usable_memory_gib is not None:  # nobody's total found: the table says how
        assert spec.memory_source.startswith("derived: "), spec.memory_source
    if seen.smi_mib is not None and spec.usable_memory_gib is not None:
        # mem_get_info's total is below nvidia-smi's / npu-smi's (the driver's share), by < 4 GiB
        smi_gib = seen.smi_mib / 1024
        assert 0 < smi_gib - spec.usable_memory_gib < 4.0, (smi_gib, spec.usable_memory_gib)
    div = 2 if seen.halve else 1
    if seen.bf16_sparse is not None:
        assert spec.bf16_tflops == pytest.approx(seen.bf16_sparse / div, rel=0.01)
    if seen.fp8_sparse is not None:
        assert spec.fp8_tflops == pytest.approx(seen.fp8_sparse / div, rel=0.01)
    elif spec.device_type == "npu" or seen.bf16_sparse == 624:
        assert spec.fp8_tflops is None  # no float8 matmul on A100 / 910B / 910C


def test_every_table_entry_has_a_real_name():
    reached = {peak_spec_for(s.name).marker for s in SEEN}
    missing = {s.marker for s in PEAK_SPECS if s.marker not in reached and s.key not in KEY_ONLY}
    assert not missing, f"give these entries a real device name in SEEN: {sorted(missing)}"


def test_the_most_specific_entry_wins():
    """A 64 GB 910B4-1 is not the 32 GB 910B4, a GH200 not an H200, a GB200 not a B200."""
    assert peak_spec_for("Ascend910B4-1").usable_memory_gib == 60.96
    assert peak_spec_for("Ascend910B4").usable_memory_gib == 28.96
    assert peak_spec_for("NVIDIA GH200 480GB").key == "gh200"
    assert peak_spec_for("NVIDIA GB200").key == "gb200"
    assert peak_spec_for("NVIDIA H20").marker == "H20"
    # Wherever one marker holds another, a name carrying the longer one picks it.
    for outer in PEAK_SPECS:
        assert peak_spec_for(f"x {outer.marker} y") is outer, outer.marker


def test_h200_is_not_budgeted_as_an_80_gb_gpu():
    """The first H200 run logged "79.60 GiB usable" (the cuda type figure) for 139.8 GiB."""
    assert device_memory_gib("h200") == 139.8 != device_memory_gib("cuda") == 79.11
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
    assert est.device_memory_bytes == int(178.35 * GIB)
