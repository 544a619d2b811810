"""Resume of bench_host_tables.py's NVMe tables (two 1.6M-row tables, lazy_adam, a 0.1 GiB
host cache): how long the checkpoint load takes and how many pages it reads and writes, for a
checkpoint saved with NVMe tables and for one saved with host tables (a whole shard column per
stored chunk).

    python benchmarks/bench_nvme_resume.py [--nvme_dir DIR --repeats 2]

Each saving run trains 2 steps and saves at step 2 (checkpoint.folder under a temporary
folder); each resume loads it into NVMe tables in fresh page files and trains one more step.
Printed per resume: the checkpoint load's seconds (CheckpointManager.load), the pages the
stores read and wrote during it, and its largest write of rows into a store (bytes of one
`load`). One rank (gloo, forked by tests/launcher.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _resume(rank: int, world: int, raw: dict) -> dict:
    import engram.checkpoint.manager as manager
    from engram.config import config_from_dict
    from engram.rowstore.nvme_store import NvmeRowStore
    from recipes.train import train

    load, resume = NvmeRowStore.load, manager.CheckpointManager.load
    stores: dict[int, NvmeRowStore] = {}
    out = {"seconds": 0.0, "largest": 0, "reads": 0, "writes": 0}

    def counted_load(self, values, *args, **kwargs):
        stores[id(self)] = self
        out["largest"] = max(out["largest"], sum(v.nbytes for v in values.values()))
        return load(self, values, *args, **kwargs)

    def timed(self):
        before = {k: (s.reads, s.writes) for k, s in stores.items()}
        NvmeRowStore.load = counted_load
        t0 = time.perf_counter()
        try:
            return resume(self)
        finally:
            out["seconds"] = time.perf_counter() - t0
            NvmeRowStore.load = load
            for k, s in stores.items():
                r, w = before.get(k, (0, 0))
                out["reads"] += s.reads - r
                out["writes"] += s.writes - w

    def note_store(self, *args, **kwargs):  # every store, also those the init made
        stores[id(self)] = self
        return load(self, *args, **kwargs)

    NvmeRowStore.load = note_store
    manager.CheckpointManager.load = timed
    train(config_from_dict(raw))
    return out


def _save(rank: int, world: int, raw: dict) -> None:
    from engram.config import config_from_dict
    from recipes.train import train

    train(config_from_dict(raw))


def main() -> None:
    from bench_host_tables import _raw
    from launcher import run_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme_dir", default=str(ROOT / "outputs" / "bench_nvme_pages"))
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    nvme = {"dir": args.nvme_dir, "gib": 0.1}
    tmp = tempfile.mkdtemp(prefix="bench_nvme_resume.")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| saved with | load s | pages read | pages written | largest write into a store (B) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    try:
        for saved_with in ("nvme", "host"):
            raw = _raw(tmp, f"save_{saved_with}", 1, saved_with, 2, nvme)
            raw.pop("bench_page_io")
            raw["checkpoint"] = {"enable": True, "interval": 2, "keep_latest_k": 0}
            run_distributed(_save, 1, raw, timeout=3600)
            runs = []
            for rep in range(args.repeats):
                again = _raw(tmp, f"save_{saved_with}", 1, "nvme", 3, nvme)
                again.pop("bench_page_io")
                again["engram"]["nvme_dirs"] = [f"{args.nvme_dir}/resume{rep}"]
                again["checkpoint"] = {"enable": True, "interval": 100, "keep_latest_k": 0,
                                       "load_step": 2}  # fmt: skip
                again["metrics"]["enable_tensorboard"] = False
                runs.append(run_distributed(_resume, 1, again, timeout=3600)[0])
            seconds = [r["seconds"] for r in runs]
            each = ", ".join(f"{s:.1f}" for s in seconds)
            print(f"| {saved_with} tables | {statistics.median(seconds):.1f} ({each}) | "
                  f"{runs[0]['reads']} | {runs[0]['writes']} | {runs[0]['largest']} |")  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
