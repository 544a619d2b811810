"""Engram and table-tier telemetry of log steps: what the gates, the tables and their storage
did, into metrics.jsonl and TensorBoard with the other log-step metrics (docs/telemetry.md says
how to read each curve).

Per Engram layer L (keys `engram/layer_L/...`), over the log step's tokens on every rank:

    gate_mean         mean gate value (sigmoid, per position and hc branch)
    gate_open_frac    share of gates above 0.5
    gate_entropy      mean binary entropy of the gates (nats; ln 2 = 0.693 is a coin flip)
    out_rms_ratio     RMS of the Engram branch's output over the RMS of the residual it is added to
    rows_touched      distinct table rows the step's update touched, summed over the owner ranks
    update_rms        RMS of what the update added to those rows (optimizer step, no weight decay)

Per table tier (keys `tier/...`, host / NVMe tables; summed over the rank's NVMe tables and over
ranks, counted over the steps since the previous log step: the window):

    pages_read_demand, pages_read_ahead, pages_written, cache_hit_pct (of the pages the step's
    lookups pinned, those already in host memory), page_in_wait_s (seconds loads waited for
    page-ins still in flight), io_mb_s (pages moved per second of the window)

How, without a host sync per layer: `recording(step)` opens the Engram blocks' statistics
channel (engram/models/engram_stats.py) around the forward / backward of a log step only, and
arms the table optimizers' update statistics (engram/optim/update_stats.py) around its update;
the sums stay device tensors. `metrics()` (called by Progress on log steps, next to the loss's
read) stacks them with the tier counters into one vector, all-reduces it once over every rank
(each rank's tokens and shard rows; a pipeline stage fills only its own layers), and reads it
once. Host / NVMe table updates run on the host worker: their statistics are read after
`wait_host_work`, on log steps only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from engram.config import JobConfig
from engram.models import engram_stats
from engram.models.engram_stats import EngramStats
from engram.optim.lazy_adam import RowSparseOptimizer
from engram.optim.update_stats import TableUpdateStats, dense_adam_update, mark_dense_touched
from engram.rowstore.host_worker import is_host_resident, row_store_of, wait_host_work
from engram.train.metrics import is_log_step

__all__ = ["TIER_COUNTERS", "StepTelemetry", "engram_tables"]

TIER_COUNTERS = (
    "pages_read_demand", "pages_read_ahead", "pages_written", "lookup_pages", "lookup_hits",
    "page_in_wait_s", "bytes_moved",
)  # fmt: skip
_TABLE_FIELDS = 3  # rows touched, update_sq, update_n (update_stats.TableUpdateStats.values)


def _compute_device(model_parts: list[nn.Module]) -> torch.device:
    """Where the model computes: the device of its first parameter not kept on the host."""
    for part in model_parts:
        for p in part.parameters():
            if not is_host_resident(p) and p.device.type != "meta":
                return p.device
    return torch.device("cpu")


def engram_tables(model_parts: list[nn.Module]) -> dict[int, torch.Tensor]:
    """{Engram layer id: its table's weight parameter} of this rank's model parts (an engine's
    model inside `.module`)."""
    found = {}
    for part in model_parts:
        inner = part if hasattr(part, "engram_blocks") else getattr(part, "module", part)
        for layer_id, block in inner.engram_blocks().items():
            found[layer_id] = block.table.weight
    return found


class StepTelemetry:
    """The Engram and tier telemetry of one run's log steps (see the module docstring). Built
    with the step; `recording(step)` around a step's forward, backward and update; `metrics()`
    on log steps (collective: every rank calls it on the same steps)."""

    def __init__(
        self,
        cfg: JobConfig,
        model_parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
    ) -> None:
        self.cfg, self.device = cfg, _compute_device(model_parts)
        self.enabled = cfg.metrics.telemetry
        """metrics.telemetry; a benchmark flips it between steps (benchmarks/bench_mfu.py)."""
        self.layer_ids = list(cfg.engram.layer_ids) if cfg.engram.enabled else []
        self.tables = engram_tables(model_parts)
        ours = {id(p) for p in self.tables.values()}
        self.table_optimizers = [
            opt for opt in optimizers
            if any(id(p) in ours for g in opt.param_groups for p in g["params"])
        ]  # fmt: skip
        self.engram = EngramStats(self.layer_ids, self.device) if self.layer_ids else None
        self.updates: TableUpdateStats | None = None
        self.stores = [s for s in map(row_store_of, self.tables.values()) if s is not None]
        self.stores = [s for s in self.stores if hasattr(s, "io_counters")]  # NVMe stores
        self._io_last = self._io_totals()
        self._t_last = time.perf_counter()

    def is_log_step(self, step: int) -> bool:
        """Whether step `step` records (a log step, with telemetry on)."""
        return self.enabled and is_log_step(self.cfg, step)

    def recording(self, step: int):
        """Around the forward / backward of step `step`: on a log step, the Engram blocks add
        their statistics (nothing otherwise)."""
        if self.engram is None or not self.is_log_step(step):
            return nullcontext()
        self.engram.reset()
        return engram_stats.recording(self.engram)

    @contextmanager
    def update(self, step: int, skip: bool) -> Iterator[None]:
        """Around the optimizers' update of step `step`: on a log step, the table optimizers
        record what they touched and added (a skipped update records nothing)."""
        if not self.layer_ids or not self.table_optimizers or skip or not self.is_log_step(step):
            yield
            return
        stats = self.updates = TableUpdateStats()
        dense = [o for o in self.table_optimizers if not isinstance(o, RowSparseOptimizer)]
        for opt in self.table_optimizers:
            if isinstance(opt, RowSparseOptimizer):
                opt.update_stats = stats
        for opt in dense:
            for p in self._table_params(opt):
                mark_dense_touched(stats, p)
        try:
            yield
        finally:
            for opt in self.table_optimizers:
                if isinstance(opt, RowSparseOptimizer):
                    opt.update_stats = None
        for opt in dense:
            for p in self._table_params(opt):
                dense_adam_update(stats, opt, p)

    def _table_params(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        ours = {id(p) for p in self.tables.values()}
        return [p for g in opt.param_groups for p in g["params"] if id(p) in ours]

    def _io_totals(self) -> list[float]:
        totals = [0.0] * len(TIER_COUNTERS)
        for store in self.stores:
            counters = store.io_counters()
            totals = [t + counters[k] for t, k in zip(totals, TIER_COUNTERS, strict=True)]
        return totals

    def metrics(self) -> dict[str, float]:
        """The log step's telemetry, reduced over every rank (one all-reduce, one host read);
        the tier counters over the window since the previous call. The vector has the same
        length on every rank (a stage without some layers or tables sends zeros there)."""
        if not self.layer_ids or not self.enabled:
            return {}
        if any(is_host_resident(p) for p in self.tables.values()):
            wait_host_work()  # the host update of this step writes its statistics
        tables = torch.zeros(len(self.layer_ids), _TABLE_FIELDS, device=self.device)
        for i, layer_id in enumerate(self.layer_ids):
            if self.updates is not None and layer_id in self.tables:
                tables[i] = self.updates.values(self.tables[layer_id], self.device)
        self.updates = None
        now, io = time.perf_counter(), self._io_totals()
        window = [a - b for a, b in zip(io, self._io_last, strict=True)] + [now - self._t_last]
        self._io_last, self._t_last = io, now
        assert self.engram is not None
        flat = torch.cat([
            self.engram.sums.flatten(), tables.flatten(),
            torch.tensor(window, dtype=torch.float32).to(self.device),
        ])  # fmt: skip
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        values = flat.tolist()
        k, n = len(engram_stats.FIELDS), len(self.layer_ids)
        out = self._engram_metrics(values[: n * k], values[n * k : n * (k + _TABLE_FIELDS)])
        if self.cfg.engram.table_location == "nvme":
            out |= _tier_metrics(values[n * (k + _TABLE_FIELDS) :])
        return out

    def _engram_metrics(self, gates: list[float], tables: list[float]) -> dict[str, float]:
        out: dict[str, float] = {}
        k = len(engram_stats.FIELDS)
        for i, layer_id in enumerate(self.layer_ids):
            key = f"engram/layer_{layer_id}"
            g = dict(zip(engram_stats.FIELDS, gates[i * k : (i + 1) * k], strict=True))
            if g["positions"] > 0:
                out[f"{key}/gate_mean"] = g["gate_sum"] / g["positions"]
                out[f"{key}/gate_open_frac"] = g["gate_high"] / g["positions"]
                out[f"{key}/gate_entropy"] = g["gate_entropy"] / g["positions"]
                out[f"{key}/out_rms_ratio"] = math.sqrt(g["out_sq"] / max(g["residual_sq"], 1e-30))
            touched, sq, count = tables[i * _TABLE_FIELDS : (i + 1) * _TABLE_FIELDS]
            out[f"{key}/rows_touched"] = touched
            out[f"{key}/update_rms"] = math.sqrt(sq / count) if count else 0.0
        return out


def _tier_metrics(window: list[float]) -> dict[str, float]:
    """The tier keys from the window's summed counters and its length (last entry: seconds,
    summed over ranks, so the mean over ranks is used for the rate)."""
    c = dict(zip(TIER_COUNTERS, window[:-1], strict=True))
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    seconds = window[-1] / ranks
    pinned = c["lookup_pages"]
    return {
        "tier/pages_read_demand": c["pages_read_demand"],
        "tier/pages_read_ahead": c["pages_read_ahead"],
        "tier/pages_written": c["pages_written"],
        "tier/cache_hit_pct": 100 * c["lookup_hits"] / pinned if pinned else 100.0,
        "tier/page_in_wait_s": c["page_in_wait_s"],
        "tier/io_mb_s": c["bytes_moved"] / 1e6 / seconds if seconds > 0 else 0.0,
    }
