"""CPU affinity near the device (engram/runtime/affinity.py): the sysfs parsing, the pinning
that the host-table worker thread inherits, and "unknown -> not pinned".

sysfs is a temporary folder laid out like /sys; pinning runs in a forked child so the pytest
process keeps its CPUs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
import types
from pathlib import Path

import pytest
import torch

from engram.runtime import affinity
from engram.runtime.affinity import numa_node_cpus, parse_cpulist, pin_to_device_numa

ADDRESS = "0000:1b:00.0"
needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="needs Linux sched_setaffinity"
)


def _fake_sys(root: Path, node: str, cpulist: str) -> Path:
    dev = root / "bus/pci/devices" / ADDRESS
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(f"{node}\n")
    if node.strip().lstrip("-").isdigit() and int(node) >= 0:
        cpus = root / f"devices/system/node/node{node}"
        cpus.mkdir(parents=True)
        (cpus / "cpulist").write_text(f"{cpulist}\n")
    return root


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]
    assert parse_cpulist("") == []
    with pytest.raises(ValueError, match="not a cpulist"):
        parse_cpulist("0-x")


def test_numa_node_from_sysfs(tmp_path: Path) -> None:
    root = _fake_sys(tmp_path / "a", "1", "4-7,12")
    assert numa_node_cpus(ADDRESS, root) == (1, [4, 5, 6, 7, 12])
    # unknown: no address, no such device, firmware that says -1
    assert numa_node_cpus(None, root) is None
    assert numa_node_cpus("0000:ff:00.0", root) is None
    assert numa_node_cpus(ADDRESS, _fake_sys(tmp_path / "b", "-1", "")) is None


def test_cuda_pci_address_from_device_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    props = types.SimpleNamespace(pci_bus_id=0x1B, pci_domain_id=0, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    assert affinity.pci_address(torch.device("cuda", 0)) == ADDRESS
    assert affinity.pci_address(torch.device("cpu")) is None
    assert affinity.pci_address(torch.device("meta")) is None  # npu and others: unknown


def _in_child(fn, *args) -> object:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()

    def run() -> None:
        try:
            queue.put((True, fn(*args)))
        except BaseException:
            queue.put((False, traceback.format_exc()))

    proc = ctx.Process(target=run)
    proc.start()
    ok, value = queue.get(timeout=60)
    proc.join(timeout=10)
    assert ok, value
    return value


def _pin_and_report(root: str) -> tuple[str, set[int], set[int]]:
    from engram.rowstore.host_worker import HOST_WORKER

    message = pin_to_device_numa(torch.device("cpu"), "numa", Path(root), address=ADDRESS)
    # the host-table worker thread, started after the pinning, inherits it
    worker = HOST_WORKER.submit(os.sched_getaffinity, 0).result()
    return message, os.sched_getaffinity(0), worker


@needs_affinity
def test_pinning_reaches_the_host_worker_thread(tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    root = _fake_sys(tmp_path, "1", str(cpu))
    message, main, worker = _in_child(_pin_and_report, str(root))
    assert main == worker == {cpu}, (main, worker)
    assert message == "CPU affinity: pinned to NUMA node 1 of cpu (1 CPUs)"


def _unchanged(root: str, mode: str, address: str | None) -> tuple[str, bool]:
    before = os.sched_getaffinity(0)
    message = pin_to_device_numa(torch.device("cpu"), mode, Path(root), address=address)
    return message, os.sched_getaffinity(0) == before


@needs_affinity
def test_unknown_node_or_off_pins_nothing(tmp_path: Path) -> None:
    known = _fake_sys(tmp_path / "known", "0", "0")
    unknown = _fake_sys(tmp_path / "unknown", "-1", "")
    message, same = _in_child(_unchanged, str(unknown), "numa", ADDRESS)
    assert same and message == "CPU affinity: NUMA node unknown for cpu, not pinned"
    message, same = _in_child(_unchanged, str(known), "numa", None)  # no PCI address (cpu, npu)
    assert same and "NUMA node unknown" in message
    message, same = _in_child(_unchanged, str(known), "none", ADDRESS)
    assert same and message == "CPU affinity: not pinned (job.cpu_affinity = none)"
    with pytest.raises(ValueError, match="numa"):
        pin_to_device_numa(torch.device("cpu"), "socket")
