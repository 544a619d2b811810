"""The device-table twins that the host- and NVMe-table tests compare against
(tests/test_parallelisms_host_tables.py, tests/test_parallelisms_nvme_tables.py).

Both files train their device twins with `device_twin` through tests/shared_runs.py, so a run
that several tests compare to trains once per session (a file's tests share runs; the two
files share nothing they rely on, so either can run alone)."""

from __future__ import annotations

import json
from pathlib import Path

from small_job import small_job

from engram.config import config_from_dict

# The NVMe tests' tables: big enough that a step's rows are a small share of the pages: 800k
# rows x 16 (51 MB of fp32 weights per table, 3x with lazy_adam's moments) against a host cache
# of 5 MiB / ranks (a rank's shard is still 10x its cache; a step's rows, at most 4 MiB / ranks
# of pages, fit).
VOCAB = [200003, 199999]
CACHE_MIB = 5
STEPS = 4


def table_raw(tmp: str, name: str, world: int, location: str, opt: str, extra: dict | None = None):
    """The small job with Engram tables at `location` and table optimizer `opt`; `extra` merged
    per section; the global batch stays 8 over the data-parallel ranks and micro-batches."""
    extra = extra or {}
    sections = {
        "engram": {"table_location": location},
        "optimizer": {"table_optimizer": opt},
        **{k: v for k, v in extra.items() if k not in ("engram", "optimizer")},
    }
    for key in ("engram", "optimizer"):
        sections[key] = {**sections[key], **extra.get(key, {})}
    raw = small_job(tmp, f"{name}_{location}", world, 4, sections)
    accum = raw["training"].get("grad_accum_steps", 1)
    par = raw["parallelism"]
    dp = par.get("dp_shard", world) * par.get("dp_replicate", 1)
    raw["training"]["local_batch_size"] = 8 // dp // accum
    return raw


def nvme_raw(tmp, name: str, world: int, location: str, opt: str, extra: dict | None = None):
    """`table_raw` at the NVMe tests' table size over STEPS steps, every step logged; NVMe tables
    in two page folders under `tmp` with a host cache of CACHE_MIB / world, no drive probe.
    `extra` (a layout's sections) is merged per section, as table_raw does."""
    extra = extra or {}
    engram = {"vocab_size_per_ngram": VOCAB}
    if location == "nvme":
        # nvme_probe_s 0: no drive probe (test_nvme_equals_device has one)
        engram |= {"nvme_dirs": [f"{tmp}/nvme_a", f"{tmp}/nvme_b"], "nvme_create_dirs": True,
                   "nvme_host_cache_gib": CACHE_MIB / world / 1024, "nvme_probe_s": 0.0}  # fmt: skip
    layout = {**extra, "engram": {**engram, **extra.get("engram", {})}}
    raw = table_raw(str(tmp), name, world, location, opt, layout)
    raw["training"]["steps"] = STEPS
    raw["metrics"]["log_freq"] = 1  # every step's telemetry (engram/train/telemetry.py)
    return raw


PP = {"pipeline": {"schedule": "1F1B", "microbatches": 2}, "engram": {"layer_ids": [0, 2]}}
# Layouts both files train (the host file at its own table size).
SHARED_LAYOUTS = {
    "fsdp2tp2": (4, {"parallelism": {"dp_shard": 2, "tp": 2}}),
    "pp2tp2": (4, {"parallelism": {"dp_shard": 1, "pp": 2, "tp": 2}, **PP}),
}


def device_twin(rank: int, world: int, raw: dict, nan_steps: tuple[int, ...] = ()) -> dict:
    """Train `raw` (device tables); return what both files compare: losses, grad norms, every
    table's full rows (by parameter name), rank 0's metrics records and the Engram telemetry of
    its steps, and the names of any host / NVMe table modules (none). `nan_steps`: steps whose
    loss is poisoned."""
    from torch.distributed.tensor import DTensor

    import recipes.train as recipe

    if nan_steps:
        from test_recipes_faults import poison_loss

        poison_loss(nan_steps)
    result = recipe.train(config_from_dict(raw))
    tables = {}
    for part in result.model_parts:
        for n, p in part.named_parameters():
            if ".table." in n:
                tables[n] = p.full_tensor().detach().clone() if isinstance(p, DTensor) else p
    run = Path(raw["job"]["dump_folder"]) / raw["job"]["run_name"]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if "loss" in r][-len(result.losses) :]
    host = [type(m).__name__ for m in result.model.modules() if "Host" in type(m).__name__]
    nvme = [type(m).__name__ for m in result.model.modules() if "Nvme" in type(m).__name__]
    return {
        "losses": result.losses,
        "norms": result.grad_norms,
        "tables": tables,
        "metrics": metrics if rank == 0 else [],
        "telemetry": [{k: v for k, v in r.items() if k.startswith("engram/")} for r in steps]
        if rank == 0
        else [],
        "host_tables": host,
        "stores": nvme,  # none: a device run has no NVMe stores
    }
