"""What a device offers, stated once with its sources: the memory PyTorch can use and the dense
bf16 / fp8 peaks (MFU divides by the bf16 one), per device model (PEAK_SPECS, matched by the name
the device reports or by its key, the planner's --device) and per device type (DEVICE_SPECS, the
fallback for models the table does not know).

Usable memory is the total `mem_get_info` reports on that model, not the nameplate: the
nameplate less the share the driver / firmware keep (a "64 GB" Ascend Atlas A2 reports 60.96 GiB,
a "141 GB" H200 139.8 GiB, an 80 GB H100 79.11 where nvidia-smi shows 79.65). Each entry cites
where its figure was reported, or says "derived" and how. The memory planner budgets against it by default
(`--device` / `--device_memory_gib` override) and adds its own reserve for the runtime context
and collective buffers (`--reserve_gib`, 3 GiB) to every peak; at run time the device's
`mem_get_info` total beats this table (engram/train/throughput.py log_device_memory logs which
figure it used and where it came from).
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
        usable_memory_gib=60.96,
        memory_source=(
            "the 64 GB Atlas A2's total as PyTorch reports it (60.96 GiB: "
            "vllm-project/vllm-ascend#1670; A3 reports 61.27); the lower figure"
        ),
    ),
    "cuda": DeviceSpec(
        name="NVIDIA 80 GB class (A100 80GB, H100)",
        usable_memory_gib=79.11,
        memory_source=(
            "the H100 80GB's mem_get_info total (79.11 GiB, vllm-project/vllm#27508; the "
            "A100 80GB reports 79.14); the lower figure"
        ),
    ),
}


def usable_memory_gib(device: str) -> float | None:
    """The table's usable memory of a device type (cuda, npu) or model key (h200; DEVICE_MODELS),
    None where the table has no figure (cpu)."""
    try:
        return device_memory_gib(device)
    except ValueError:
        return None


# --- per device model: memory and dense bf16 / fp8 peaks ---------------------------------------


@dataclass(frozen=True)
class PeakSpec:
    """One device model, matched by a substring of the name the device module reports
    (torch.cuda / torch.npu .get_device_name()) or by its `key` (the planner's --device):
    dense (no sparsity) matrix peaks and, where stated, the memory it reports to PyTorch."""

    marker: str
    name: str
    bf16_tflops: float
    source: str
    """Where the peaks come from."""
    key: str = ""
    """The planner CLI's name for it (--device h200); "" for devices only MFU looks up."""
    device_type: str = "cuda"
    fp8_tflops: float | None = None
    """Dense fp8 peak; None where the device has no fp8 matmul (A100, 910B / 910C)."""
    nameplate: str = ""
    """The memory the vendor sells ("141 GB HBM3e")."""
    usable_memory_gib: float | None = None
    """What the device reports to PyTorch as its total, GiB: the nameplate less the share the
    driver / firmware keep (ECC, the runtime's reservation); None where no figure is stated."""
    memory_source: str = ""


_NV_DATASHEET = "NVIDIA datasheet, dense (half the sparsity figure)"
_A100_80 = (
    "80 GB HBM2e",
    79.14,
    "mem_get_info total 79.14 GiB on an A100 80GB (OOM message in "
    "lianqi1008/Control-GIC#6; levihsu/OOTDiffusion#235 reports 79.25): the lower figure",
)
_A2_64 = (
    "64 GB HBM2e",
    60.96,
    "PyTorch's total on a 64 GB Atlas A2: 60.96 GiB (NPU OOM messages in "
    "vllm-project/vllm-ascend#1670, vllm-project/vllm-omni#1199; 60.97 in vllm-ascend#19)",
)
_A2_PEAK = (
    "verl _DEVICE_FLOPS ('910B': 354e12), one figure for the 910B bins; no fp8 matmul on 910B "
    "(Ascend operator docs: FP8 only on 950): set metrics.peak_tflops if your bin's sheet differs"
)

# Matched by the longest marker the reported name contains, so the most specific entry wins
# wherever one marker holds another ("GH200" over "H200", "GB200" over "B200", "Ascend910B4-1"
# over "Ascend910B4", "H200" over "H20"). Peaks as torchtitan's `get_peak_flops`
# (torchtitan/tools/utils.py), verl's `_DEVICE_FLOPS` and torchao's roofline_utils state them
# (vendors' dense figures). Usable memory is the total torch.cuda / torch.npu .mem_get_info
# reports on that model (or the "total capacity" of its OOM message, the same figure), each
# with its source, or "derived" and how. Names as torch.cuda / torch_npu .get_device_name()
# return them: "NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB", "Ascend910B2", "Ascend910B4-1"
# (the 64 GB 910B4), "Ascend910_9391" (Atlas A3, 910C: one torch device per die);
# tests/test_device_specs.py lists one real name per entry with where it was seen.
PEAK_SPECS: tuple[PeakSpec, ...] = (
    PeakSpec(
        "H100 NVL", "NVIDIA H100 NVL", 835.0, _NV_DATASHEET, "h100-nvl", "cuda", 1671.0,
        "94 GB HBM3", 93.0, "mem_get_info total 93.00 GiB on an H100 NVL (OOM message in "
        "ali-vilab/VACE#56)",
    ),
    PeakSpec(
        "H100 PCIe", "NVIDIA H100 PCIe", 756.0, _NV_DATASHEET, "h100-pcie", "cuda", 1513.0,
        "80 GB HBM2e", 79.11, "derived: the H100 SXM's figure (no PCIe total found; both "
        "report 81,559 MiB in nvidia-smi, modal-labs/modal-client#2797)",
    ),
    PeakSpec(
        "H100", "NVIDIA H100 SXM", 989.0, _NV_DATASHEET, "h100", "cuda", 1979.0,
        "80 GB HBM3", 79.11, "mem_get_info total 79.11 GiB on an H100 80GB (OOM message in "
        "vllm-project/vllm#27508)",
    ),
    PeakSpec(
        "H200", "NVIDIA H200", 989.0, _NV_DATASHEET + " (H200 = H100 SXM compute)", "h200",
        "cuda", 1979.0, "141 GB HBM3e", 139.8,
        "mem_get_info total 139.8 GiB on an H200 (this project's first accelerator run, "
        "2026-12-03, driver 580.159.04)",
    ),
    PeakSpec(
        "GH200 144G", "NVIDIA GH200 144G HBM3e", 989.0, _NV_DATASHEET + " (GH200: H100 SXM "
        "compute)", "gh200-144g", "cuda", 1979.0, "144 GB HBM3e", 139.8,
        "derived: no total found; the H200's 139.8 GiB (same HBM3e, 141 GB enabled) as a lower "
        "bound",
    ),
    PeakSpec(
        "GH200", "NVIDIA GH200 480GB (96 GB HBM3)", 989.0, _NV_DATASHEET + " (GH200: H100 SXM "
        "compute)", "gh200", "cuda", 1979.0, "96 GB HBM3", 94.88,
        "mem_get_info total 94.88 GiB on a GH200 (OOM message in Lightning-AI/litgpt#1892)",
    ),
    PeakSpec("H800", "NVIDIA H800", 989.0, "verl _DEVICE_FLOPS", "", "cuda", 1979.0),
    PeakSpec("H20", "NVIDIA H20", 148.0, "verl _DEVICE_FLOPS", "", "cuda", 296.0),
    PeakSpec(
        "B200", "NVIDIA B200", 2250.0, "torchao roofline_utils (bf16 2.25e15, fp8 4.5e15 dense; "
        "HGX B200 datasheet)", "b200", "cuda", 4500.0, "180 GB HBM3e", 178.35,
        "totalGlobalMem 178.35 GiB on a B200 (pytorch/ao#4002; the total mem_get_info reports, "
        "178.4 GiB on sm100 in sgl-project/sglang#25225)",
    ),
    PeakSpec(
        "GB200", "NVIDIA GB200 (per GPU)", 2500.0, "GB200 NVL72 datasheet: 180 PFLOPS dense "
        "bf16, 360 fp8 over 72 GPUs", "gb200", "cuda", 5000.0, "186 GB HBM3e", 184.3,
        "derived: no total found; 186 GB per GPU (NVL72: 13.4 TB / 72) less the 1.65 GiB the "
        "B200 reports below its 180 GB nameplate (178.35)",
    ),
    PeakSpec(
        "A100-SXM4-40GB", "NVIDIA A100 40GB", 312.0, "torchtitan get_peak_flops "
        "(nvidia.com/a100); no fp8", "a100-40gb", "cuda", None, "40 GB HBM2", 39.39,
        "totalGlobalMem 42,298,834,944 bytes (39.39 GiB) on an A100-SXM4-40GB (deviceQuery in "
        "bottlerocket-os/bottlerocket#3873)",
    ),
    PeakSpec(
        "A100-PCIE-40GB", "NVIDIA A100 40GB PCIe", 312.0, "torchtitan get_peak_flops "
        "(nvidia.com/a100); no fp8", "", "cuda", None, "40 GB HBM2", 39.39,
        "derived: the A100-SXM4-40GB's figure (same memory)",
    ),
    PeakSpec(
        "A100", "NVIDIA A100 80GB", 312.0, "torchtitan get_peak_flops (nvidia.com/a100); no fp8",
        "a100-80gb", "cuda", None, *_A100_80,
    ),
    PeakSpec("A800", "NVIDIA A800", 312.0, "verl _DEVICE_FLOPS", "", "cuda"),
    PeakSpec("L40S", "NVIDIA L40S", 362.0, "torchtitan get_peak_flops (L40S datasheet)"),
    PeakSpec("MI300X", "AMD MI300X", 1300.0, "torchtitan get_peak_flops (amd.com mi300x)"),
    PeakSpec("MI325X", "AMD MI325X", 1300.0, "torchtitan get_peak_flops (amd.com mi325x)"),
    PeakSpec(
        "Ascend910_93", "Ascend 910C (Atlas A3, per die)", 354.0,
        "no public per-die bf16 figure found; the 910B figure (a 910C is two 910B-class dies, "
        "each one torch device); no fp8: set metrics.peak_tflops if your sheet differs",
        "910c", "npu", None, "64 GB per die (128 GB per package)", 61.27,
        "PyTorch's total per die on A3: 61.27 GiB (NPU OOM message in sgl-project/sglang#29838)",
    ),
    PeakSpec("Ascend910B1", "Ascend 910B1 (Atlas A2)", 354.0, _A2_PEAK, "910b1", "npu", None, *_A2_64),
    PeakSpec("Ascend910B2", "Ascend 910B2 (Atlas A2)", 354.0, _A2_PEAK, "910b2", "npu", None, *_A2_64),
    PeakSpec("Ascend910B3", "Ascend 910B3 (Atlas A2)", 354.0, _A2_PEAK, "910b3", "npu", None, *_A2_64),
    PeakSpec(
        "Ascend910B4-1", "Ascend 910B4-1 (Atlas A2, 64 GB)", 354.0, _A2_PEAK, "910b4-1", "npu",
        None, "64 GB HBM2e", 60.96, "derived: the 64 GB A2 bins' 60.96 GiB (npu-smi shows "
        "65,536 MB HBM on a 910B4-1, Project-HAMi/HAMi-WebUI#47)",
    ),
    PeakSpec(
        "Ascend910B4", "Ascend 910B4 (Atlas A2, 32 GB)", 354.0, _A2_PEAK, "910b4", "npu", None,
        "32 GB HBM2e", 28.96, "derived: 32 GiB (npu-smi 32,768 MB, vllm-project/vllm-ascend#8746) "
        "less the 3.04 GiB the 64 GB bins keep (64 - 60.96); pass your mem_get_info total as "
        "--device_memory_gib",
    ),
    PeakSpec(
        "Ascend910B", "Ascend 910B (Atlas A2)", 354.0, _A2_PEAK, "910b", "npu", None, *_A2_64
    ),
)  # fmt: skip
DEVICE_MODELS = {s.key: s for s in PEAK_SPECS if s.key}
"""The device models the planner's --device names (lower case)."""


def peak_spec_for(device_name: str) -> PeakSpec | None:
    """The most specific table entry for `device_name`: of the markers it contains
    (case-insensitive), the longest; None if none."""
    low = device_name.lower()
    found = [s for s in PEAK_SPECS if s.marker.lower() in low]
    return max(found, key=lambda s: len(s.marker), default=None)


def device_memory_gib(device: str) -> float:
    """The planner's budget for `device`: a model key (h200, 910b2; DEVICE_MODELS) or a device
    type (cuda, npu; DEVICE_SPECS). Raises ValueError naming the valid names otherwise."""
    low = device.lower()
    model = DEVICE_MODELS.get(low)
    if model is not None and model.usable_memory_gib is not None:
        return model.usable_memory_gib
    if low in DEVICE_SPECS:
        return DEVICE_SPECS[low].usable_memory_gib
    raise ValueError(
        f"unknown device {device!r}: use a device type ({', '.join(DEVICE_SPECS)}) or a model "
        f"({', '.join(DEVICE_MODELS)}), or give the budget with --device_memory_gib"
    )


# What the memory planner keeps free of every device's usable memory for the runtime context and
# the communicators' buffers (its --reserve_gib default; planner/estimate.py adds it to each peak).
PLANNER_RESERVE_GIB = 3.0


@dataclass(frozen=True)
class MemoryFigure:
    """The usable memory a run plans and warns with, and where it came from."""

    usable_gib: float
    source: str  # "mem_get_info" | "table (name matched)" | "table (type fallback)"
    detail: str
    warning: str | None = None

    @property
    def for_tensors_gib(self) -> float:
        """What is left for tensors once the planner's reserve is taken off."""
        return self.usable_gib - PLANNER_RESERVE_GIB

    def describe(self) -> str:
        return (
            f"{self.usable_gib:.2f} GiB usable ({self.source}: {self.detail}); less the "
            f"planner's {PLANNER_RESERVE_GIB:g} GiB reserve (--reserve_gib: runtime context, "
            f"communicators) {self.for_tensors_gib:.2f} GiB for tensors"
        )


def resolve_memory(
    device_type: str, device_name: str, reported_total_gib: float | None = None
) -> MemoryFigure | None:
    """Usable memory of the device at hand: the total it reports (mem_get_info) where there is
    one, else the table's figure for its name, else its type's (with a warning that names the
    fix). None on cpu (no table entry, no device total)."""
    spec = peak_spec_for(device_name) if device_type != "cpu" else None
    fallback = DEVICE_SPECS.get(device_type)
    warning = None
    if spec is not None and spec.usable_memory_gib is not None:
        table_gib, source = spec.usable_memory_gib, "table (name matched)"
        table = f"{spec.name} {table_gib:.1f} GiB, name matched {spec.marker!r}"
    elif fallback is not None:
        table_gib, source = fallback.usable_memory_gib, "table (type fallback)"
        table = f"{device_type} type figure {table_gib:.1f} GiB ({fallback.name})"
        warning = (
            f"device_specs has no memory figure for {device_name!r}: add it to PEAK_SPECS in "
            "engram/runtime/device_specs.py; meanwhile plan with --device_memory_gib and set "
            "metrics.peak_tflops for MFU"
        )
    else:
        return None if reported_total_gib is None else MemoryFigure(
            reported_total_gib, "mem_get_info", "the device's total; no table entry"
        )  # fmt: skip
    if reported_total_gib is not None:
        return MemoryFigure(
            reported_total_gib, "mem_get_info", f"the device's total; table: {table}", warning
        )
    return MemoryFigure(table_gib, source, table, warning)


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
    gemm_dtype: torch.dtype | None = None  # a measured peak's GEMM dtype (to time it again)

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
    detail = f"{why}: {str(dtype).removeprefix('torch.')} GEMM now"
    return Peak(measured, "measured", detail, dtype)
