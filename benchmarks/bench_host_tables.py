"""Step time with host-resident Engram tables vs device tables, and bytes moved per step; with
`--locations host,nvme`, NVMe tables vs host tables.

    python benchmarks/bench_host_tables.py [--steps 30 --warmup 5 --worlds 1,2 --pairs 5]
    python benchmarks/bench_host_tables.py --locations host,nvme [--nvme_dir DIR --cache_gib 0.1]
    python benchmarks/bench_host_tables.py --locations host,nvme,nvme:syscalls

Workload: the debug Llama (dim 256, 4 layers) with Engram at layers 1 and 2, orders 2-3, 4 heads
per order, 32 wide per head, vocab_size_per_ngram [200000, 200000] (~51 M table parameters per
table), batch 8 x 128 tokens per step (global; split over the ranks), lazy_adam, fp32 on CPU
(gloo ranks forked by tests/launcher.py, one thread each). Per world size the locations run
alternately, `--pairs` times (a pair: the base location, then each other one), so a change of
the machine's load hits both sides of a pair alike. Each run's median step_time_s (metrics.jsonl,
after `--warmup` steps) is taken; a row gives each location's median over its runs and the
median of the per-pair ratios with their min-max. On a CPU machine host and device memory are
the same RAM: the host path's cost measured here is its extra work (host gather through the
worker thread, staging, the async update's thread hand-off), not a PCIe copy. Bytes per step:
rows gathered on the host and sent to the device (H2D) plus row gradients (and their int64 row
ids) brought to the host (D2H), summed over ranks, averaged over steps.

CPU accounting (rank 0, after the warmup, per step, median over a location's runs): the
process's CPU seconds, split into the main thread, the host worker (gathers, updates, the NVMe
store's page cache) and the NVMe store's I/O threads (AIO batches, checksums), and the main
thread's seconds waiting for prefetched rows. On a loaded machine these move less than wall time.

NVMe: page files under `--nvme_dir` (default outputs/bench_nvme_pages in the repository; it must
be a real disk: tmpfs and ramfs are refused unless `--allow_tmpfs`), each rank's host cache
`--cache_gib` split over its two tables. A line per location gives its page counts summed over
ranks, median over its runs: at init (before step 1: the layout-independent init writing the
tables) and per step after it (pages read, of them paged in ahead of their step, written back,
and the pins that waited for a page-in still in flight). `nvme:syscalls`: NVMe tables with the
store's page I/O by preadv / pwritev on its I/O threads instead of native AIO batches
(engram/rowstore/linux_aio.py); `nvme:nochecksum`: without the page checksums (what they cost,
engram/rowstore/page_sums.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PAGE_KEYS = ("reads", "paged_in", "writes", "waits")


def _raw(folder: str, name: str, world: int, variant: str, steps: int, nvme: dict) -> dict:
    location = variant.split(":")[0]
    raw = {
        "job": {"dump_folder": folder, "run_name": name, "device": "cpu", "seed": 0},
        "model": {"name": "llama3", "flavor": "debug"},
        "engram": {
            "layer_ids": [1, 2],
            "n_head_per_ngram": 4,
            "vocab_size_per_ngram": [200000, 200000],
            "n_embed_per_ngram": 128,
            "table_location": location,
        },
        "training": {"seq_len": 128, "local_batch_size": 8 // world, "steps": steps},
        "data": {"synthetic_num_entities": 256, "eval_batches": 0},
        "optimizer": {"lr": 1e-3, "table_optimizer": "lazy_adam"},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "parallelism": {"dp_shard": world},
    }
    raw["bench_page_io"] = variant.split(":")[1] if ":" in variant else "aio"
    if location == "nvme":
        raw["engram"] |= {
            "nvme_dirs": [f"{nvme['dir']}/{name}"],
            "nvme_create_dirs": True,
            "nvme_host_cache_gib": nvme["gib"],
        }
    return raw


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, by role."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {"main": 0.0, "host_worker": 0.0, "io": 0.0, "other": 0.0}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        seconds = (int(fields[11]) + int(fields[12])) / tick
        name = names.get(int(tid), "")
        if int(tid) == os.getpid():
            role = "main"
        elif name.startswith("engram-host"):
            role = "host_worker"
        elif name.startswith("engram-nvme"):
            role = "io"
        else:
            role = "other"
        out[role] += seconds
    return out


def _store_pages(model_parts) -> dict[str, int]:
    pages = dict.fromkeys(PAGE_KEYS, 0)  # NVMe: summed over tables
    for part in model_parts:
        for m in part.modules():
            store = getattr(m, "_engram_store", None)
            if store is not None:
                pages["paged_in"] += store.paged_in
                pages["reads"] += store.reads
                pages["writes"] += store.writes
                pages["waits"] += store.page_in_waits
    return pages


def _worker(rank: int, world: int, raw: dict, warmup: int) -> dict:
    import torch

    import engram.rowstore.memory as rs
    import engram.rowstore.page_io as page_io
    import runner.step as step_mod
    from engram.config import config_from_dict
    from engram.optim.lazy_adam import RowSparseOptimizer
    from engram.rowstore.host_worker import is_host_resident
    from parallelisms.engram_tables.host import HostShardedEngramTable
    from recipes.train import train

    moved = {"h2d": 0, "d2h": 0}
    gather, row_grad = rs._gather, RowSparseOptimizer._row_grad
    staged_rows, step_call = HostShardedEngramTable._staged_rows, step_mod.TrainStep.__call__
    acct = {"wait_s": 0.0, "steps": 0, "cpu0": None, "cpu1": None, "init": None, "t0": 0.0}

    def counted_gather(host, local_idx, device):
        out = gather(host, local_idx, device)
        moved["h2d"] += out[0].numel() * out[0].element_size()
        return out

    def counted_row_grad(p):
        rg = row_grad(p)
        if rg is not None and is_host_resident(p):
            moved["d2h"] += sum(t.numel() * t.element_size() for t in rg)
        return rg

    def timed_staged_rows(self, ids):
        t0 = time.perf_counter()
        out = staged_rows(self, ids)
        if acct["cpu0"] is not None:
            acct["wait_s"] += time.perf_counter() - t0
        return out

    def accounted_step(self, batches, step, ahead=None):
        if acct["init"] is None:  # the tables' init is over: its page counts
            acct["init"] = _store_pages(self.model_parts)
        if step == warmup + 1:
            acct["cpu0"] = _thread_cpu()
        out = step_call(self, batches, step, ahead)
        if acct["cpu0"] is not None:
            out.loss.item()  # the step's work is done (its host update may still be queued)
            acct["cpu1"] = _thread_cpu()
            acct["steps"] += 1
        return out

    variant = raw.pop("bench_page_io")
    if variant == "syscalls":
        page_io.aio_available = lambda: "off (benchmark variant nvme:syscalls)"
    if variant == "nochecksum":  # what the page checksums cost: the same store without them
        page_io.page_sums = lambda buf, slots, pages: torch.zeros(len(slots), dtype=torch.int32)
    rs._gather = counted_gather
    RowSparseOptimizer._row_grad = staticmethod(counted_row_grad)
    HostShardedEngramTable._staged_rows = timed_staged_rows
    step_mod.TrainStep.__call__ = accounted_step
    cfg = config_from_dict(raw)
    result = train(cfg)
    steps = raw["training"]["steps"]
    total = _store_pages(result.model_parts)
    init = acct["init"] or dict.fromkeys(PAGE_KEYS, 0)
    per_step = {k: (total[k] - init[k]) / steps for k in PAGE_KEYS}
    n = max(1, acct["steps"])
    cpu = {k: (acct["cpu1"][k] - acct["cpu0"][k]) / n for k in acct["cpu0"]}
    cpu["wait_rows"] = acct["wait_s"] / n
    times = []
    if rank == 0:
        for line in (cfg.run_folder / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("step", 0) > warmup and "step_time_s" in rec:
                times.append(rec["step_time_s"])
    return {
        "times": times, "h2d": moved["h2d"] / steps, "d2h": moved["d2h"] / steps,
        "init": init, "per_step": per_step, "cpu": cpu,
    }  # fmt: skip


def _filesystem(path: Path) -> str:
    """The file system type of the mount holding `path` (/proc/mounts; "" if unknown)."""
    path, best, kind = path.resolve(), "", ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        fields = line.split()
        point = fields[1].replace("\\040", " ")
        if (str(path) + "/").startswith(point.rstrip("/") + "/") and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def _nvme_dir(args: argparse.Namespace) -> Path:
    folder = Path(args.nvme_dir or ROOT / "outputs" / "bench_nvme_pages")
    folder.mkdir(parents=True, exist_ok=True)
    kind = _filesystem(folder)
    if kind in ("tmpfs", "ramfs") and not args.allow_tmpfs:
        sys.exit(
            f"--nvme_dir {folder} is on {kind} (memory, not a disk): its page I/O says nothing "
            "about a drive. Point --nvme_dir at a folder on a local disk, or pass --allow_tmpfs"
        )
    print(f"NVMe page files under {folder} ({kind or 'unknown file system'})")
    return folder


def pair_ratios(base: list[float], other: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of other / base step times, pair by pair (run i of each location ran
    back to back, so a change of the machine's load hits both sides of a pair alike)."""
    if len(base) != len(other) or not base:
        raise ValueError(f"pairs need as many runs of each location: {len(base)} vs {len(other)}")
    ratios = [o / b for o, b in zip(other, base, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def _median_dict(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--pairs", type=int, default=5, help="alternating runs per location")
    ap.add_argument(
        "--locations", default="device,host", help="base,other...: device,host | host,nvme"
    )
    ap.add_argument("--nvme_dir", default=None, help="NVMe page files (a folder on a disk)")
    ap.add_argument("--allow_tmpfs", action="store_true", help="accept --nvme_dir on tmpfs")
    ap.add_argument("--cache_gib", type=float, default=0.1, help="NVMe host cache per rank")
    args = ap.parse_args()
    base, *others = args.locations.split(",")
    if not others:
        sys.exit("--locations needs a base and at least one other location")
    runs_dir = tempfile.mkdtemp(prefix="bench_host_tables.")  # metrics.jsonl of each run
    nvme = {"dir": None, "gib": args.cache_gib}
    if any(loc.startswith("nvme") for loc in (base, *others)):
        nvme["dir"] = str(_nvme_dir(args))
    load = os.getloadavg()[0]
    print(f"load average at start {load:.1f} on {os.cpu_count()} cores")
    rows, notes = [], []
    try:
        _measure(args, base, others, nvme, runs_dir, rows, notes)
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)
    print(
        f"| ranks | location | pairs | {base} step (s) | its step (s) | its / {base}: median "
        "(min-max) | H2D MiB / step | D2H MiB / step |"
    )
    print("| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |")
    print("\n".join(rows))
    print("\n".join(notes))
    print(f"load average at end {os.getloadavg()[0]:.1f} (start {load:.1f})")


def _measure(args, base: str, others: list[str], nvme: dict, runs_dir: str, rows, notes) -> None:
    """Alternating runs per world size; appends a table row per other location to `rows` and
    the CPU and page lines to `notes`."""
    from launcher import run_distributed

    for world in (int(w) for w in args.worlds.split(",")):
        runs: dict[str, list[dict]] = {loc: [] for loc in (base, *others)}
        for pair in range(args.pairs):
            for loc in (base, *others):
                name = f"{loc.replace(':', '_')}{world}_{pair}"
                raw = _raw(runs_dir, name, world, loc, args.steps, nvme)
                res = run_distributed(_worker, world, raw, args.warmup, timeout=3600)
                runs[loc].append({
                    "step": statistics.median(res[0]["times"]),
                    "h2d": sum(r["h2d"] for r in res), "d2h": sum(r["d2h"] for r in res),
                    "init": {k: sum(r["init"][k] for r in res) for k in PAGE_KEYS},
                    "per_step": {k: sum(r["per_step"][k] for r in res) for k in PAGE_KEYS},
                    "cpu": res[0]["cpu"],
                })  # fmt: skip
        host = runs.get("host", runs[base])
        h2d, d2h = (statistics.median(r[k] for r in host) / 2**20 for k in ("h2d", "d2h"))
        b = statistics.median(r["step"] for r in runs[base])
        for loc in others:
            mid, lo, hi = pair_ratios(
                [r["step"] for r in runs[base]], [r["step"] for r in runs[loc]]
            )
            o = statistics.median(r["step"] for r in runs[loc])
            rows.append(
                f"| {world} | {loc} | {len(runs[loc])} | {b:.3f} | {o:.3f} | "
                f"**{mid:.3f}** ({lo:.3f}-{hi:.3f}) | {h2d:.2f} | {d2h:.2f} |"
            )
        for loc in (base, *others):
            cpu = _median_dict([r["cpu"] for r in runs[loc]])
            notes.append(
                f"  {world} rank(s), {loc}: CPU s / step (rank 0) "
                + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items())
            )
            if loc.startswith("nvme"):
                init = _median_dict([r["init"] for r in runs[loc]])
                step = _median_dict([r["per_step"] for r in runs[loc]])
                notes.append(
                    f"  {world} rank(s), {loc} pages (all ranks, median of runs): init "
                    + ", ".join(f"{k} {v:.0f}" for k, v in init.items())
                    + "; per step "
                    + ", ".join(f"{k} {v:.0f}" for k, v in step.items())
                )


if __name__ == "__main__":
    main()
