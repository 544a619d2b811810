"""Page I/O cost of the NVMe row store's two engines on one disk: 4 KiB pages at random offsets
of an O_DIRECT file, written and read by a loop of os.pwritev / os.preadv (a syscall per page,
the store's fallback) and by native AIO batches (engram/rowstore/linux_aio.py, the
default), wall and CPU time per page (CPU: this process, kernel time included).

    python benchmarks/bench_page_io.py --dir DIR [--pages 6000 --file_gib 1 --repeats 2]

DIR must be on the drive to measure (not tmpfs: O_DIRECT is refused there). The file is
preallocated and written once before the timed reads, so reads hit written blocks.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.rowstore.linux_aio import DEPTH, AioContexts, aio_available  # noqa: E402

PAGE = 4096


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--pages", type=int, default=6000)
    ap.add_argument("--file_gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if aio_available() is not None:
        sys.exit(f"native AIO unavailable: {aio_available()}")
    path = Path(args.dir) / "bench_page_io.pages"
    file_pages = int(args.file_gib * 2**30) // PAGE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, file_pages * PAGE)
        n = args.pages
        buf = mmap.mmap(-1, n * PAGE)
        slots = torch.frombuffer(buf, dtype=torch.uint8).view(n, PAGE)
        pages = torch.randperm(file_pages)[:n]
        aio = AioContexts()
        addrs = slots.data_ptr() + PAGE * torch.arange(n)
        fds = torch.full((n,), fd)

        def by_syscalls(write: bool) -> None:
            move = os.pwritev if write else os.preadv
            view = memoryview(buf)
            for i, p in enumerate(pages.tolist()):
                move(fd, [view[i * PAGE : (i + 1) * PAGE]], p * PAGE)

        def by_aio(write: bool) -> None:
            for lo in range(0, n, DEPTH):  # as the store submits them
                part = slice(lo, lo + DEPTH)
                aio.run(fds[part], addrs[part], pages[part] * PAGE, PAGE, write)

        by_aio(True)  # every timed read hits written blocks
        print(f"{n} random 4 KiB pages of a {args.file_gib:g} GiB O_DIRECT file in {args.dir}")
        print("| engine | op | wall us / page | CPU us / page |")
        print("| --- | --- | ---: | ---: |")
        for _ in range(args.repeats):
            for name, fn in (("pwritev/preadv", by_syscalls), ("native AIO", by_aio)):
                for write in (True, False):
                    t0, c0 = time.perf_counter(), time.process_time()
                    fn(write)
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    op = "write" if write else "read"
                    print(f"| {name} | {op} | {1e6 * wall / n:.1f} | {1e6 * cpu / n:.1f} |")
        aio.close()
    finally:
        os.close(fd)
        path.unlink()


if __name__ == "__main__":
    main()
