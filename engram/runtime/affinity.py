"""Pin this process to the CPUs of its device's NUMA node (job.cpu_affinity = "numa").

Why: the host side of a step (op dispatch, the host-table worker thread, the data-loader workers
that hash ids) slows down when the OS moves it across sockets away from the device's PCIe root;
the Ascend launch scripts pin each rank near its NPU for this reason. The main thread is pinned
at start-up, before the host-table worker thread (engram/rowstore/host_worker.py) and the
data-loader workers exist: Linux threads and child processes inherit their creator's affinity,
so they run on the same node.

The node comes from sysfs (Linux): /sys/bus/pci/devices/<pci address>/numa_node, then the node's
/sys/devices/system/node/node<N>/cpulist. The PCI address is known for CUDA devices (their
properties carry it); for NPUs torch_npu does not expose it, so an NPU (and the CPU) is
"NUMA node unknown" and nothing is pinned.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SYS = Path("/sys")
CPU_AFFINITY_MODES = ("numa", "none")


def parse_cpulist(text: str) -> list[int]:
    """Linux's cpulist format ("0-3,8,10-11") -> sorted CPU ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"not a cpulist: {text!r} (expected e.g. '0-3,8,10-11')") from None
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def pci_address(device: torch.device) -> str | None:
    """The device's PCI address as sysfs names it ("0000:1b:00.0"), None where unknown."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, str):
        return bus.lower()
    if bus is None:
        return None
    domain = getattr(props, "pci_domain_id", 0)
    dev = getattr(props, "pci_device_id", 0)
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def numa_node_cpus(address: str | None, sys_root: Path = SYS) -> tuple[int, list[int]] | None:
    """(node, its CPUs) of the PCI device at `address`, None when sysfs does not say."""
    if address is None:
        return None
    try:
        node = int((sys_root / "bus/pci/devices" / address / "numa_node").read_text())
        if node < 0:  # -1: a single-node machine or firmware that does not tell
            return None
        cpulist = (sys_root / f"devices/system/node/node{node}/cpulist").read_text()
    except (OSError, ValueError):
        return None
    cpus = parse_cpulist(cpulist)
    return (node, cpus) if cpus else None


def pin_to_device_numa(
    device: torch.device, mode: str = "numa", sys_root: Path = SYS, address: str | None = None
) -> str:
    """Pin this process to its device's NUMA node when known (mode "numa"); return the log line.

    `address` overrides the device's PCI address (tests)."""
    if mode not in CPU_AFFINITY_MODES:
        raise ValueError(f"cpu affinity mode must be one of {CPU_AFFINITY_MODES}, got {mode!r}")
    if mode == "none":
        return "CPU affinity: not pinned (job.cpu_affinity = none)"
    if not hasattr(os, "sched_setaffinity"):
        return "CPU affinity: not pinned (no sched_setaffinity on this OS)"
    found = numa_node_cpus(address or pci_address(device), sys_root)
    if found is None:
        return f"CPU affinity: NUMA node unknown for {device}, not pinned"
    node, cpus = found
    allowed = sorted(set(cpus) & os.sched_getaffinity(0))
    if not allowed:  # a container that does not own that node's CPUs: keep what it gave us
        return f"CPU affinity: NUMA node {node}'s CPUs are outside this process's set, not pinned"
    os.sched_setaffinity(0, allowed)
    return f"CPU affinity: pinned to NUMA node {node} of {device} ({len(allowed)} CPUs)"
