"""Native AIO batches (engram/rowstore/linux_aio.py) against plain reads of the same
file: scattered pages written and read back in batches longer than one submission, each I/O's
result reported (an error as -errno, a read past the end as a short count)."""

from __future__ import annotations

import errno
import mmap
import os

import pytest
import torch

from engram.rowstore.linux_aio import DEPTH, AioContexts, aio_available

PAGE = 4096

pytestmark = pytest.mark.skipif(aio_available() is not None, reason=str(aio_available()))


def _open_direct(path):
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        pytest.skip("O_DIRECT refused on this file system")


def test_scattered_pages_round_trip_and_errors_per_io(tmp_path):
    n_file, n = 4 * DEPTH, DEPTH + 37  # more than one submission, fewer pages than the file
    fd = _open_direct(tmp_path / "pages")
    os.posix_fallocate(fd, 0, n_file * PAGE)
    buf = mmap.mmap(-1, n * PAGE)
    slots = torch.frombuffer(buf, dtype=torch.int32).view(n, PAGE // 4)
    pages = torch.randperm(n_file, generator=torch.Generator().manual_seed(0))[:n]
    slots.copy_(pages.view(-1, 1) * 1000 + torch.arange(PAGE // 4))  # each page its own content
    want = slots.clone()
    addrs = slots.data_ptr() + PAGE * torch.arange(n)
    fds = torch.full((n,), fd)
    aio = AioContexts()
    assert torch.equal(aio.run(fds, addrs, pages * PAGE, PAGE, write=True), torch.full((n,), PAGE))
    slots.zero_()
    back = torch.randperm(n)  # read into other slots than they were written from
    res = aio.run(fds, addrs[back], pages * PAGE, PAGE, write=False)
    assert torch.equal(res, torch.full((n,), PAGE))
    assert torch.equal(slots[back], want)
    plain = os.open(tmp_path / "pages", os.O_RDONLY)
    for i in range(0, n, 97):  # and the file holds them where a plain read finds them
        got = torch.frombuffer(
            bytearray(os.pread(plain, PAGE, int(pages[i]) * PAGE)), dtype=torch.int32
        )
        assert torch.equal(got, want[i])
    # per-I/O results: a misaligned buffer is refused (-EINVAL), a read past the end is short
    res = aio.run(
        torch.full((2,), fd), torch.tensor([slots.data_ptr() + 512 + 1, slots.data_ptr()]),
        torch.tensor([0, n_file * PAGE]), PAGE, write=False,
    )  # fmt: skip
    assert res.tolist() == [-errno.EINVAL, 0]
    aio.close()
    os.close(fd)
    os.close(plain)
