"""What a device offers, stated once with its sources: the memory PyTorch can use and the dense
bf16 peak that MFU divides by.

Usable memory is what the device reports as its total to PyTorch, not the nameplate: a "64 GB"
Ascend Atlas A2 / A3 reports about 61 GiB. The memory planner budgets against it by default
(`--device_memory_gib` overrides), and a measured `mem_get_info` total beats this table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    usable_memory_gib: float
    """Total memory the device reports to PyTorch, GiB: the budget layouts are planned against."""
    memory_source: str


DEVICE_SPECS: dict[str, DeviceSpec] = {
    "npu": DeviceSpec(
        name="Ascend Atlas A2 / A3 (64 GB HBM per NPU)",
        usable_memory_gib=61.0,
        memory_source=(
            "PyTorch reports 60.97 GiB total on a 64 GB Atlas A2 (vllm-project/vllm-ascend#19) "
            "and 61.27 GiB on A3 (sgl-project/sglang#29838, modelscope/ms-swift#7871); the "
            "lower figure, rounded"
        ),
    ),
    "cuda": DeviceSpec(
        name="NVIDIA 80 GB class (A100 80GB, H100)",
        usable_memory_gib=79.6,
        memory_source=(
            "nvidia-smi reports 81,559 MiB total on an H100 80GB and 81,920 MiB on an A100 80GB "
            "(modal-labs/modal-client#2797); the lower figure"
        ),
    ),
}


def usable_memory_gib(device_type: str) -> float | None:
    """The table's usable memory of a device type, None where the table has no entry (cpu)."""
    spec = DEVICE_SPECS.get(device_type)
    return spec.usable_memory_gib if spec else None


# --- dense bf16 peak: the MFU denominator ----------------------------------------------------


@dataclass(frozen=True)
class PeakSpec:
    """One device's dense (no sparsity) bf16 matrix peak, matched by a substring of the name the
    device module reports (torch.cuda / torch.npu .get_device_name())."""

    marker: str
    name: str
    bf16_tflops: float
    source: str


# First match wins: the more specific markers come first. Figures are the vendors' dense bf16
# (tensor / cube unit) peaks as torchtitan's `get_peak_flops` (torchtitan/tools/utils.py) and
# verl's `_DEVICE_FLOPS` (verl/utils/flops_counter.py) state them. Ascend names as torch_npu
# reports them: "Ascend910B1".."Ascend910B4" (Atlas A2), "Ascend910_93xx" (Atlas A3; one torch
# device per die), the markers torchtitan-npu's tools/device.py maps to A2 / A3.
PEAK_SPECS: tuple[PeakSpec, ...] = (
    PeakSpec("H100 NVL", "NVIDIA H100 NVL", 835.0, "torchtitan get_peak_flops (nvidia.com/h100)"),
    PeakSpec("H100 PCIe", "NVIDIA H100 PCIe", 756.0, "torchtitan get_peak_flops (nvidia.com/h100)"),
    PeakSpec("H100", "NVIDIA H100 SXM", 989.0, "torchtitan get_peak_flops (nvidia.com/h100)"),
    PeakSpec("H200", "NVIDIA H200", 989.0, "torchtitan get_peak_flops (nvidia.com/h200)"),
    PeakSpec("H800", "NVIDIA H800", 989.0, "verl _DEVICE_FLOPS"),
    PeakSpec("H20", "NVIDIA H20", 148.0, "verl _DEVICE_FLOPS"),
    PeakSpec("B200", "NVIDIA B200", 2250.0, "torchtitan get_peak_flops (Blackwell datasheet)"),
    PeakSpec("A100", "NVIDIA A100", 312.0, "torchtitan get_peak_flops (nvidia.com/a100)"),
    PeakSpec("A800", "NVIDIA A800", 312.0, "verl _DEVICE_FLOPS"),
    PeakSpec("L40S", "NVIDIA L40S", 362.0, "torchtitan get_peak_flops (L40S datasheet)"),
    PeakSpec("MI300X", "AMD MI300X", 1300.0, "torchtitan get_peak_flops (amd.com mi300x)"),
    PeakSpec("MI325X", "AMD MI325X", 1300.0, "torchtitan get_peak_flops (amd.com mi325x)"),
    PeakSpec(
        "Ascend910_93",
        "Ascend Atlas A3 (910C, per die)",
        354.0,
        "no public per-die bf16 figure found; the 910B figure below (a 910C is two 910B-class "
        "dies, each one torch device): set metrics.peak_tflops if your vendor sheet says otherwise",
    ),
    PeakSpec(
        "Ascend910B",
        "Ascend Atlas A2 (910B1-B4)",
        354.0,
        "verl _DEVICE_FLOPS ('910B': 354e12); one figure for every 910B variant (the B3 / B4 "
        "bins are lower): set metrics.peak_tflops for yours",
    ),
)


def peak_spec_for(device_name: str) -> PeakSpec | None:
    """The table entry whose marker occurs in `device_name` (case-insensitive), None if none."""
    low = device_name.lower()
    return next((s for s in PEAK_SPECS if s.marker.lower() in low), None)


def measure_gemm_tflops(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    n: int = 512,
    budget_s: float = 0.25,
) -> float:
    """Achieved TFLOP/s of square n x n matmuls on `device`, best of repeated timings within
    about `budget_s` seconds (after one warm-up): the CPU's peak stand-in, measured not looked up.
    On 2 shared cores the figure moves with the machine's load; it is what this process got."""
    gen = torch.Generator().manual_seed(0)  # its own: the run's global RNG stream is untouched
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    (a @ b).sum().item()  # warm-up: thread pool, kernels
    best, start, flops = 0.0, time.perf_counter(), 2.0 * n**3
    while time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        (a @ b).sum().item()  # .item(): waits for an accelerator too
        best = max(best, flops / (time.perf_counter() - t0))
    return best / 1e12


@dataclass(frozen=True)
class Peak:
    """The peak a run's MFU divides by, and where it came from."""

    tflops: float
    source: str  # "config" | "table" | "measured"
    detail: str

    def describe(self) -> str:
        return f"peak {self.tflops:,.1f} TFLOP/s per device ({self.source}: {self.detail})"


def resolve_peak(
    device_type: str, device_name: str, override_tflops: float = 0.0, cpu_dtype=torch.float32
) -> Peak:
    """metrics.peak_tflops if set (> 0), else the table's entry for `device_name`, else (cpu, or a
    device the table does not know) a short GEMM on this device measured now."""
    if override_tflops > 0:
        return Peak(override_tflops, "config", "metrics.peak_tflops")
    spec = peak_spec_for(device_name) if device_type != "cpu" else None
    if spec is not None:
        return Peak(spec.bf16_tflops, "table", f"{spec.name}, dense bf16; {spec.source}")
    device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type, 0)
    dtype = cpu_dtype if device_type == "cpu" else torch.bfloat16
    measured = measure_gemm_tflops(device, dtype)
    why = "cpu" if device_type == "cpu" else f"{device_name!r} is not in device_specs.PEAK_SPECS"
    return Peak(measured, "measured", f"{why}: {str(dtype).removeprefix('torch.')} GEMM now")
