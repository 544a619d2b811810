"""What a device offers, stated once with its sources: the memory PyTorch can use.

Usable memory is what the device reports as its total to PyTorch, not the nameplate: a "64 GB"
Ascend Atlas A2 / A3 reports about 61 GiB. The memory planner budgets against it by default
(`--device_memory_gib` overrides), and a measured `mem_get_info` total beats this table.
"""

from __future__ import annotations

from dataclasses import dataclass


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
