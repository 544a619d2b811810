"""CPU cost of the NVMe row store per training step, without the model: where the store's time
goes (the page cache's bookkeeping, gathers and scatters of rows, page checksums, the AIO
batches), per step and per page moved.

    python benchmarks/bench_nvme_store.py --dir DIR [--steps 20 --rows 1600218 --dim 32 \\
        --lookups 8192 --cache_mib 51.2]

The store is bench_host_tables.py's NVMe table (one of its two: 1.6M rows of 32-wide weights
with lazy_adam's two moments, a 51.2 MiB host cache), replayed the way a step drives it on the
host worker: the last step's pins end, this step's rows are pinned and read (the prefetch), the
next step's rows are paged in ahead, and the update reads and writes this step's rows. Each
step looks up `--lookups` random rows (the benchmark's batch: 8 x 128 tokens x 8 heads); the
same step's rows are drawn for every variant. Reported per step: CPU seconds of the thread
that drives the store (the host worker's role) and of the store's I/O threads (this process's
other threads), pages read and written; and per page moved, the CPU microseconds of each.
`--no_checksums` times the same replay with the page checksums off (their cost is the
difference). CPU time is what a loaded machine distorts least; the wall time is printed too.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.rowstore import page_io  # noqa: E402
from engram.rowstore.nvme_store import NvmeRowStore  # noqa: E402


def _cpu_by_thread() -> tuple[float, float]:
    """(CPU s of this thread, CPU s of the process's other threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    me, others = threading.get_native_id(), 0.0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        others += (int(fields[11]) + int(fields[12])) / tick
    return time.thread_time(), others


def replay(args: argparse.Namespace, steps_idx: list[torch.Tensor], checksums: bool) -> dict:
    if not checksums:
        page_io.page_sums = lambda buf, slots, pages: torch.zeros(len(slots), dtype=torch.int32)
    store = NvmeRowStore(
        args.rows, {"weight": args.dim, "exp_avg": args.dim, "exp_avg_sq": args.dim},
        [args.dir], int(args.cache_mib * 2**20), name="bench_store",
    )  # fmt: skip
    try:
        gen = torch.Generator().manual_seed(0)
        for r0 in range(0, args.rows, 1 << 18):  # the init: weights, zero moments
            n = min(1 << 18, args.rows - r0)
            store.load({"weight": torch.rand(n, args.dim, generator=gen)}, row0=r0)
        init_reads, init_writes = store.reads, store.writes
        t0, (me0, io0) = time.perf_counter(), _cpu_by_thread()
        reads0, writes0 = store.reads, store.writes
        for step, idx in enumerate(steps_idx):
            rows = torch.unique(idx)
            store.release_all()
            store.pin(rows)
            store.read_rows(rows)
            if step + 1 < len(steps_idx):
                store.page_in_now(torch.unique(steps_idx[step + 1]))
            got = store.read_columns(rows)
            store.write_columns(rows, {k: v + 1e-3 for k, v in got.items()})
            store.release_all()
        store.cache.settle()
        wall, (me1, io1) = time.perf_counter() - t0, _cpu_by_thread()
        n = len(steps_idx)
        return {
            "wall": wall / n, "store_cpu": (me1 - me0) / n, "io_cpu": (io1 - io0) / n,
            "reads": (store.reads - reads0) / n, "writes": (store.writes - writes0) / n,
            "init_reads": init_reads, "init_writes": init_writes,
        }  # fmt: skip
    finally:
        store.close()
        store.remove_files()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="a folder on the drive to measure")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1_600_218)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--lookups", type=int, default=8192)
    ap.add_argument("--cache_mib", type=float, default=51.2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    steps_idx = [torch.randint(0, args.rows, (args.lookups,), generator=gen)
                 for _ in range(args.steps + 3)]  # fmt: skip
    from engram.rowstore.page_sums import page_sums

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.steps} steps "
          f"of {args.lookups} lookups; {args.rows} rows x 3 x {args.dim} fp32, "
          f"{args.cache_mib} MiB cache, page files in {args.dir}")  # fmt: skip
    print("| checksums | wall s / step | store CPU s / step | I/O threads CPU s / step | "
          "pages read / written per step | CPU us per page moved (store, I/O) |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for _ in range(args.repeats):
        for checksums in (True, False):
            page_io.page_sums = page_sums
            r = replay(args, steps_idx, checksums)
            moved = r["reads"] + r["writes"]
            print(f"| {'on' if checksums else 'off'} | {r['wall']:.4f} | {r['store_cpu']:.4f} | "
                  f"{r['io_cpu']:.4f} | {r['reads']:.0f} / {r['writes']:.0f} | "
                  f"{1e6 * r['store_cpu'] / moved:.2f}, {1e6 * r['io_cpu'] / moved:.2f} |")  # fmt: skip
    print(f"init: {r['init_reads']} pages read, {r['init_writes']} written")


if __name__ == "__main__":
    main()
