"""The memory backends of the row store (engram/rowstore/interface.py): a table shard's rows in
device memory or in host memory (engram.table_location "device", "host").

`DeviceRowStore`: the shard tensor in device memory: reads and writes are index ops, pin /
release are no-ops. `HostRowStore`: the shard in host memory: reads for the device are host-side
gathers into page-locked staging on the FIFO host worker (engram/rowstore/host_worker.py),
copied to the device on a side stream. The NVMe backend is nvme_store.py;
parallelisms/engram_tables/sharding.py pairs each engram.table_location with its backend.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from engram.rowstore.host_worker import HOST_WORKER, wait_host_work
from engram.rowstore.interface import RowStore

__all__ = [
    "STAGING_CHUNK_BYTES",
    "DeviceRowStore",
    "HostRowStore",
    "on_device",
    "pin_staging",
]

# Page-locked staging chunks are a power of two (the caching pinned allocators round every
# request up to one, so a power of two wastes nothing) and under 128 MB (Ascend registers host
# memory with the runtime in pieces below 128 MB).
STAGING_CHUNK_BYTES = 64 * 2**20


class DeviceRowStore(RowStore):
    """A shard tensor in device memory."""

    location = "device"

    def __init__(self, shard: torch.Tensor) -> None:
        self.shard = shard

    def read_rows(self, idx: torch.Tensor) -> torch.Tensor:
        return self.shard.index_select(0, idx.to(self.shard.device))

    def write_rows(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        self.shard.index_copy_(0, idx.to(self.shard.device), rows.to(self.shard.dtype))

    def prefetch(self, idx: torch.Tensor, device: torch.device, pin: bool = True) -> Future:
        done: Future = Future()
        done.set_result((self.read_rows(idx).to(device), None))
        return done

    def snapshot(self) -> torch.Tensor:
        return self.shard


class HostRowStore(DeviceRowStore):
    """A shard tensor in host memory; reads for the device run on the host worker (FIFO behind
    the row-sparse optimizer's host updates, engram/optim/lazy_adam.py)."""

    location = "host"

    def prefetch(self, idx: torch.Tensor, device: torch.device, pin: bool = True) -> Future:
        return HOST_WORKER.submit(_gather, self.shard, idx, device)

    def snapshot(self) -> torch.Tensor:
        wait_host_work()  # queued updates write the shard
        return self.shard


def pin_staging(rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host staging buffer for `rows` rows: page-locked for an accelerator `device` (so the
    copy to it can be asynchronous), plain on CPU. Sized to a power of two bytes <= 64 MiB: the
    allocator rounds nothing up and each page-locked piece stays under Ascend's 128 MB
    registration limit; larger gathers go through it in pieces (see _gather)."""
    pinned = device.type != "cpu"  # torch's pinned allocator of the accelerator (CUDA / NPU)
    row_bytes = dim * torch.empty((), dtype=dtype).element_size()
    nbytes = min(STAGING_CHUNK_BYTES, 1 << max(0, (rows * row_bytes - 1).bit_length()))
    return torch.empty(max(1, nbytes // row_bytes), dim, dtype=dtype, pin_memory=pinned)


_SIDE_STREAMS: dict[torch.device, object] = {}


def _side_stream(device: torch.device):
    """(torch.cuda / torch.npu, this device's copy stream)."""
    mod = getattr(torch, device.type)
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = mod.Stream(device=device)
    return mod, _SIDE_STREAMS[device]


@torch.no_grad()  # grad mode is per thread: the host worker needs its own
def _gather(host: torch.Tensor, local_idx: torch.Tensor, device: torch.device):
    """(host[local_idx] on `device`, its copy's event or None). Runs on the host worker: a
    host-side gather (Ascend kernels cannot read host memory) into page-locked staging, copied
    to the device on a side stream; the lookup waits on the event (on_device)."""
    idx = local_idx.to("cpu")
    if device.type == "cpu":  # no copy to make: the gathered rows are the device's rows
        return host.index_select(0, idx), None
    n, dim = idx.numel(), host.shape[1]
    staging = pin_staging(n, dim, host.dtype, device)
    mod, stream = _side_stream(device)
    with mod.stream(stream):
        out = torch.empty((n, dim), dtype=host.dtype, device=device)
        for lo in range(0, n, staging.shape[0]):
            hi = min(n, lo + staging.shape[0])
            torch.index_select(host, 0, idx[lo:hi], out=staging[: hi - lo])
            out[lo:hi].copy_(staging[: hi - lo], non_blocking=True)
            stream.synchronize()  # the next piece reuses the staging buffer
        event = mod.Event()
        event.record(stream)
    return out, event


def on_device(gathered) -> torch.Tensor:
    """The (rows, event) of a prefetch, usable on the current stream (after the side stream's
    copy)."""
    rows, event = gathered
    if event is not None:
        current = getattr(torch, rows.device.type).current_stream(rows.device)
        current.wait_event(event)
        rows.record_stream(current)  # allocated on the side stream, used on this one
    return rows
