"""A short drive probe: random 4 KiB reads for about a second, the way the NVMe store reads its
pages (O_DIRECT, batches of linux_aio.DEPTH through native AIO where the store has it, else one
pread at a time), so start-up can set the drive's rate against the page reads a step needs
(tier_rules.probe_warning) before hours of slow steps show it.

It reads a scratch file it writes first (PROBE_BYTES of random bytes, synced): a page file right
after init is mostly allocated-but-unwritten blocks (its rows sit dirty in the host cache),
which ext4 returns as zeros without touching the drive. A buffered file (tmpfs, or a file
system that refuses O_DIRECT) reads from the page cache: the rate is then memory's, and start-up
says so (storage_warning).
"""

from __future__ import annotations

import mmap
import os
import time

import torch

from engram.rowstore.linux_aio import DEPTH, AioContexts, aio_available

__all__ = ["probe_random_reads"]

BLOCK = 4096
PROBE_BYTES = 64 * 2**20


def probe_random_reads(folder: str, seconds: float, direct: bool, seed: int = 0) -> float:
    """Random 4 KiB reads per second of a scratch file in `folder` over about `seconds` (0.0
    when `seconds` <= 0); the file is removed after."""
    if seconds <= 0:
        return 0.0
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f".engram-probe.pid{os.getpid()}")
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct and hasattr(os, "O_DIRECT") else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:  # O_DIRECT refused: buffered, as the store would be
        fd, direct = os.open(path, os.O_RDWR | os.O_CREAT, 0o600), False
    buf = mmap.mmap(-1, DEPTH * BLOCK)  # page-aligned, as O_DIRECT needs
    try:
        buf.write(os.urandom(DEPTH * BLOCK))
        for off in range(0, PROBE_BYTES, DEPTH * BLOCK):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        return _random_reads(fd, buf, PROBE_BYTES // BLOCK, seconds, direct, seed)
    finally:
        os.close(fd)
        buf.close()
        os.unlink(path)


def _random_reads(fd: int, buf: mmap.mmap, blocks: int, seconds: float, direct: bool,
                  seed: int) -> float:  # fmt: skip
    slots = torch.frombuffer(buf, dtype=torch.uint8)
    addrs = slots.data_ptr() + torch.arange(DEPTH, dtype=torch.int64) * BLOCK
    fds = torch.full((DEPTH,), fd, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    aio = AioContexts() if direct and aio_available() is None else None
    reads, start = 0, time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            offsets = torch.randint(0, blocks, (DEPTH,), generator=gen) * BLOCK
            if aio is not None:
                done = aio.run(fds, addrs, offsets, BLOCK, write=False)
                reads += int((done == BLOCK).sum())
                continue
            with memoryview(buf) as whole, whole[:BLOCK] as view:
                for off in offsets.tolist():
                    reads += os.preadv(fd, [view], off) == BLOCK
                    if time.perf_counter() - start >= seconds:
                        break
    finally:
        if aio is not None:
            aio.close()
        del slots
    return reads / (time.perf_counter() - start)
