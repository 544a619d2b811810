"""Step time with host-resident Engram tables vs device tables, and bytes moved per step; with
`--locations host,nvme`, NVMe tables vs host tables.

    python benchmarks/bench_host_tables.py [--steps 30 --warmup 5 --worlds 1,2 --repeats 2]
    python benchmarks/bench_host_tables.py --locations host,nvme --nvme_dir DIR --cache_gib 0.1
    python benchmarks/bench_host_tables.py --locations host,nvme,nvme:syscalls --nvme_dir DIR

Workload: the debug Llama (dim 256, 4 layers) with Engram at layers 1 and 2, orders 2-3, 4 heads
per order, 32 wide per head, vocab_size_per_ngram [200000, 200000] (~51 M table parameters),
batch 8 x 128 tokens per step (global; split over the ranks), lazy_adam, fp32 on CPU (gloo ranks
forked by tests/launcher.py, one thread each). Per world size the two locations run alternately
`--repeats` times; each run's median step_time_s (metrics.jsonl, after `--warmup` steps) is
taken, and the ratio host / device is the median over the pairs. On a CPU machine host and
device memory are the same RAM: the host path's cost measured here is its extra work (host
gather through the worker thread, staging, the async update's thread hand-off), not a PCIe copy.
Bytes per step: rows gathered on the host and sent to the device (H2D) plus row gradients (and
their int64 row ids) brought to the host (D2H), summed over ranks, averaged over steps.
NVMe: page files under `--nvme_dir` (a local disk; default a temporary folder), each rank's host
cache `--cache_gib` split over its two tables; the columns are then (base, other, other / base)
and the byte columns are the host path's; a line per NVMe run gives its page counts over the
whole run (pages read, of them paged in ahead of their step, written back, and the pins that
waited for a page-in still in flight). `nvme:syscalls`: NVMe tables with the store's page I/O by
preadv / pwritev on its I/O threads instead of native AIO batches (engram/rowstore/
linux_aio.py). Every location after the first gets its own row against the first, all of them
alternating within each repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


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


def _worker(rank: int, world: int, raw: dict, warmup: int) -> dict:
    import engram.rowstore.memory as rs
    import engram.rowstore.page_io as page_io
    from engram.config import config_from_dict
    from engram.optim.lazy_adam import RowSparseOptimizer
    from engram.rowstore.host_worker import is_host_resident
    from recipes.train import train

    moved = {"h2d": 0, "d2h": 0}
    gather, row_grad = rs._gather, RowSparseOptimizer._row_grad

    def counted_gather(host, local_idx, device):
        out = gather(host, local_idx, device)
        moved["h2d"] += out[0].numel() * out[0].element_size()
        return out

    def counted_row_grad(p):
        rg = row_grad(p)
        if rg is not None and is_host_resident(p):
            moved["d2h"] += sum(t.numel() * t.element_size() for t in rg)
        return rg

    if raw.pop("bench_page_io") == "syscalls":
        page_io.aio_available = lambda: "off (benchmark variant nvme:syscalls)"
    rs._gather = counted_gather
    RowSparseOptimizer._row_grad = staticmethod(counted_row_grad)
    cfg = config_from_dict(raw)
    result = train(cfg)
    steps = raw["training"]["steps"]
    pages = {"paged_in": 0, "reads": 0, "writes": 0, "waits": 0}  # NVMe: summed over tables
    for part in result.model_parts:
        for m in part.modules():
            store = getattr(m, "_engram_store", None)
            if store is not None:
                pages["paged_in"] += store.paged_in
                pages["reads"] += store.reads
                pages["writes"] += store.writes
                pages["waits"] += store.page_in_waits
    times = []
    if rank == 0:
        for line in (cfg.run_folder / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("step", 0) > warmup and "step_time_s" in rec:
                times.append(rec["step_time_s"])
    return {"times": times, "h2d": moved["h2d"] / steps, "d2h": moved["d2h"] / steps, **pages}


def main() -> None:
    from launcher import run_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--locations", default="device,host", help="base,other: device,host | host,nvme"
    )
    ap.add_argument("--nvme_dir", default=None, help="NVMe page files (default: a temp folder)")
    ap.add_argument("--cache_gib", type=float, default=0.1, help="NVMe host cache per rank")
    args = ap.parse_args()
    base, *others = args.locations.split(",")
    print(
        f"| ranks | location | {base} step (s) | its step (s) | its / {base} | H2D MiB / step | "
        "D2H MiB / step |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        nvme = {"dir": args.nvme_dir or tmp, "gib": args.cache_gib}
        for world in (int(w) for w in args.worlds.split(",")):
            med = {loc: [] for loc in (base, *others)}
            host_bytes, pages = None, []
            for rep in range(args.repeats):
                for loc in (base, *others):
                    name = f"{loc.replace(':', '_')}{world}_{rep}"
                    raw = _raw(tmp, name, world, loc, args.steps, nvme)
                    res = run_distributed(_worker, world, raw, args.warmup)
                    med[loc].append(statistics.median(res[0]["times"]))
                    if loc.startswith("nvme"):
                        run = {k: sum(r[k] for r in res) for k in res[0] if k != "times"}
                        pages.append((loc, run))
                    if loc == "host":  # the host path's gathers (the NVMe path moves pages)
                        host_bytes = (sum(r["h2d"] for r in res), sum(r["d2h"] for r in res))
            h2d, d2h = (b / 2**20 for b in host_bytes)
            d = statistics.median(med[base])
            for loc in others:
                ratio = statistics.median(o / b for o, b in zip(med[loc], med[base], strict=True))
                o = statistics.median(med[loc])
                print(
                    f"| {world} | {loc} | {d:.3f} | {o:.3f} | {ratio:.3f} | {h2d:.2f} | {d2h:.2f} |"
                )
            for (
                loc,
                run,
            ) in pages:  # whole run, warmup included: pages read (ahead), written, waited
                print(f"  {loc} pages, {world} rank(s), {args.steps} steps: {run}")


if __name__ == "__main__":
    main()
