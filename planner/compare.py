"""Candidate parallel layouts of one config at one world size, side by side.

    python scripts/estimate_memory.py --job.config_file train_configs/32b_npu.toml \
        --world_size 64 --compare [--layouts FSDP64,PP2xTP4xFSDP8] [--node_size 8]

Each layout runs the full estimator (planner/estimate.py: exact per-rank parameter,
gradient and optimizer bytes under the fake process group, activations per schedule) on one rank
per pipeline stage, which is where ranks differ; ranks of one stage differ only by a few table
rows. The global batch (sequences per optimizer step) is held fixed at the config's
local_batch_size x grad_accum_steps x dp: without PP a layout keeps the config's micro-batch and
changes grad_accum_steps; with PP one schedule step runs the dp rank's whole share as
micro-batches of one sequence each (pipeline.microbatches = local_batch_size, more micro-batches
= smaller bubble) and grad_accum_steps = 1. The schedule is the config's pipeline.schedule
when it sets pp > 1, else 1F1B. `--loss_chunks 1,8` adds a row per chunked-loss setting
(training.loss_chunks: one chunk of fp32 logits instead of the whole sequence's).

Layout names: FSDP<n>, HSDP<r>x<s>, DDP<n>, TP<t>x..., CP<c>x..., PP<p>x..., e.g.
PP2xTP4xFSDP8 or CP8xFSDP8 (context parallel: FSDP shards over dp_shard x cp, the global batch
is held over dp = dp_replicate x dp_shard; `--cp 2,4,8` adds CP candidates to the defaults,
`--cp_methods ulysses,allgather_kv` a row per method). TP needs parallelize_module / ColwiseParallel / RowwiseParallel, which torch_npu
does not yet list as supported on Atlas A2 / A3: on job.device = "npu" those layouts are marked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engram.config import ConfigError, JobConfig
from planner.estimate import estimate
from planner.layouts import (
    cp_layouts,
    default_layouts,
    inter_node_bytes,
    layout_config,
    parse_layout,
)
from planner.results import MemoryEstimate
from planner.schedule import bubble_fraction
from planner.step_model import MACHINES, Machine, step_seconds


@dataclass
class Row:
    layout: str
    micro: str
    estimate: MemoryEstimate | None = None
    error: str = ""
    bubble: float = 0.0
    inter_node: int = 0
    compute_s: float = 0.0
    overlapped_s: float = 0.0
    exposed_s: float = 0.0

    @property
    def comm_s(self) -> float:
        return self.overlapped_s + self.exposed_s

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.overlapped_s) + self.exposed_s


def compare(
    cfg: JobConfig,
    world: int,
    layouts: list[str] | None = None,
    node: int = 8,
    machine: Machine | None = None,
    local_batch_sizes: list[int] | None = None,
    loss_chunks: list[int] | None = None,
    table_locations: list[str] | None = None,
    cps: list[int] | None = None,
    cp_methods: list[str] | None = None,
    **estimate_kwargs,
) -> list[Row]:
    """One row per layout (and, without PP, per micro-batch size in `local_batch_sizes`) and
    per training.loss_chunks in `loss_chunks` (default: the config's) and per
    engram.table_location in `table_locations` (default: the config's). `cps`: context-parallel
    degrees whose candidates (layouts.cp_layouts) join the default layouts; a layout with CP
    gets a row per parallelism.cp_method in `cp_methods` (default: the config's)."""
    machine = machine or MACHINES.get(cfg.job.device, MACHINES["cuda"])
    rows = []
    runs = []
    names = layouts or default_layouts(world, node) + cp_layouts(world, node, cps or [])
    for name in names:
        pipelined = "PP" in name.upper()
        methods = cp_methods or [cfg.parallelism.cp_method]
        for method in methods if "CP" in name.upper() else [""]:
            for lbs in [0] if pipelined else local_batch_sizes or [0]:
                for chunks in loss_chunks or [cfg.training.loss_chunks]:
                    for loc in table_locations or [cfg.engram.table_location]:
                        runs.append((name, method, lbs, chunks, loc))
    for name, method, lbs, chunks, loc in runs:
        try:
            layout = parse_layout(name)
            layout.cp_method = method
            lcfg = layout_config(with_table_location(cfg, loc), layout, world, lbs)
            lcfg = dataclasses.replace(
                lcfg, training=dataclasses.replace(lcfg.training, loss_chunks=chunks)
            )
            stage_first = [c * (world // layout.pp) for c in range(layout.pp)]
            est = estimate(lcfg, world, ranks=stage_first, **estimate_kwargs)
            t = lcfg.training
            micro = (
                f"{t.local_batch_size} x 1 seq ({lcfg.pipeline.schedule})"
                if layout.pp > 1
                else f"{t.grad_accum_steps} x {t.local_batch_size} seq"
            ) + (f", {chunks} loss chunks" if chunks > 1 else "")
            p = lcfg.pipeline
            bubble = (
                bubble_fraction(p.schedule, layout.pp, p.virtual_stages, p.microbatches)
                if layout.pp > 1
                else 0.0
            )
            worst = max(est.ranks, key=lambda m: m.peak_bytes)
            inter = inter_node_bytes(layout, worst.comm, node)
            compute_s, overlapped_s, exposed_s = step_seconds(
                est, lcfg, layout, worst.comm, bubble, machine, node
            )
            if len(table_locations or []) > 1:
                micro += f", tables on {loc}"
            if layout.cp > 1:
                micro += f", {lcfg.parallelism.cp_method}"
            rows.append(
                Row(
                    name,
                    micro,
                    est,
                    bubble=bubble,
                    inter_node=inter,
                    compute_s=compute_s,
                    overlapped_s=overlapped_s,
                    exposed_s=exposed_s,
                )
            )
        except ConfigError as e:
            rows.append(Row(name, method, error=str(e)))
    return rows


def with_table_location(cfg: JobConfig, location: str) -> JobConfig:
    """The config with engram.table_location = `location` (checked like the TOML setting)."""
    if location == cfg.engram.table_location:
        return cfg
    engram = dataclasses.replace(cfg.engram, table_location=location)
    return dataclasses.replace(cfg, engram=engram)


def pick(cfg: JobConfig, rows: list[Row], margin: float) -> Row | None:
    """The planner's choice: among layouts that fit with at least `margin` of the device memory
    to spare (and, on npu, do not need tensor parallelism: torch_npu does not list
    parallelize_module / RowwiseParallel as supported on A2 / A3), the fastest modelled step;
    ties go to less communication time (overlap is never perfect), then to fewer parallel
    dimensions."""
    ok = [
        r
        for r in rows
        if r.estimate is not None
        and min(m.headroom_bytes for m in r.estimate.ranks)
        >= margin * r.estimate.device_memory_bytes
        and not (cfg.job.device == "npu" and r.estimate.tp > 1)
    ]
    return min(
        ok,
        key=lambda r: (round(r.step_s, 1), round(r.comm_s, 1), r.layout.count("x")),
        default=None,
    )
