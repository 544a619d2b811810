"""Pipeline parallelism on torch.distributed.pipelining: split the meta model into stages, build
the schedule.

    split_stages(model, cfg, dims)  -> stage modules of this pp rank (deep copies of the meta
                                       model, pruned to their layers), with their stage indices
    build_schedule(stages, ...)     -> a torch pipeline schedule over the "pp" mesh

Each stage module is the full `Transformer` class with the layers it does not own deleted from
`layers` (an nn.ModuleDict keyed by the global layer id, so parameter names, init keys, DCP keys
and HF names stay global) and `tok_embeddings` / `norm` / `output` set to None off the first /
last stage. The caller then parallelises every stage with the same `parallelize_model`
(TP -> Engram tables -> AC -> FSDP over that stage's dp x tp ranks) and materialises it.

Engram on any stage: the loader's hash ids [B, T, L, H] (all Engram layers, computed once) go to
`schedule.step(..., hash_ids=...)` as a keyword argument. torch splits keyword tensors into
micro-batches along dim 0 and hands micro-batch i's slice to every stage's forward, so a stage
picks its own layers' slots; nothing is re-hashed and nothing extra travels between stages.

Stage placement: loop style (stage s on pp rank s % pp) for every schedule except ZBVZeroBubble
and DualPipeV, which use the "v" placement (rank r holds stages r and 2 pp - 1 - r, so the first
and the last stage sit on rank 0).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _ComputationType,
    _PipelineSchedule,
    get_schedule_class,
)

from engram.config import ConfigError, JobConfig
from engram.config import Pipeline as PipelineConfig
from engram.config.table_optimizers import table_optimizer_spec
from engram.models import engram_stats
from parallelisms.engram_tables.host import lookups_off_queue
from parallelisms.parallel_dims import ParallelDims

SINGLE_STAGE = ("GPipe", "1F1B")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# Schedules that split backward into input gradients (I) and weight gradients (W); W asks
# autograd for each parameter's gradient.
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass
class StagePlan:
    """The whole pipeline's layout: which decoder layers each stage holds, which rank runs it."""

    layers: list[list[int]]  # per stage index, global layer ids
    ranks: list[int]  # per stage index, the pp rank that runs it

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def local_stages(self, pp_rank: int) -> list[int]:
        return [s for s, r in enumerate(self.ranks) if r == pp_rank]

    @property
    def last_stage_rank(self) -> int:
        return self.ranks[-1]


def stage_ranks(num_stages: int, pp: int, schedule: str) -> list[int]:
    """pp rank of every stage: loop (s % pp) or "v" (0..pp-1, then pp-1..0)."""
    if schedule in V_SHAPED:
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


def check_schedule(p: PipelineConfig, pp: int, local_batch_size: int) -> int:
    """Validate schedule / virtual stages / micro-batches; returns the micro-batch count."""
    v, name = p.virtual_stages, p.schedule
    if name in SINGLE_STAGE and v != 1:
        raise ConfigError(
            f"pipeline.schedule={name} runs one stage per rank but pipeline.virtual_stages={v}: "
            "set virtual_stages = 1, or use a looped schedule (Interleaved1F1B, LoopedBFS, "
            "InterleavedZeroBubble)"
        )
    if name not in SINGLE_STAGE and name not in V_SHAPED and v < 2:
        raise ConfigError(
            f"pipeline.schedule={name} is a looped schedule and needs virtual stages: set "
            "pipeline.virtual_stages >= 2 (stages per rank), or use GPipe / 1F1B"
        )
    if name in V_SHAPED and v != 2:
        raise ConfigError(
            f"pipeline.schedule={name} places two stages per rank in a 'v': set "
            f"pipeline.virtual_stages = 2 (got {v})"
        )
    num_stages = pp * v
    n = p.microbatches or num_stages
    if local_batch_size % n:
        raise ConfigError(
            f"pipeline.microbatches={n} does not divide training.local_batch_size="
            f"{local_batch_size}: choose a micro-batch count that divides the local batch"
        )
    need = {"GPipe": 1, "LoopedBFS": 1, **{s: num_stages for s in V_SHAPED}}.get(name, pp)
    if n < need:
        raise ConfigError(
            f"pipeline.schedule={name} needs at least {need} micro-batches with {num_stages} "
            f"stages on pp={pp} ranks, got pipeline.microbatches={n}: raise "
            "pipeline.microbatches (and training.local_batch_size), or use GPipe"
        )
    if name not in SINGLE_STAGE and name not in V_SHAPED:
        rounds = max(1, n // pp)
        if n % rounds:
            raise ConfigError(
                f"pipeline.schedule={name} runs pipeline.microbatches={n} in {rounds} rounds "
                f"(microbatches // pp={pp}), which must divide it: use a multiple of pp"
            )
    return n


def plan_stages(n_layers: int, p: PipelineConfig, pp: int) -> StagePlan:
    """Decoder layers per stage from split_points, layers_per_stage, or an even split."""
    num_stages = pp * p.virtual_stages
    how = f"pp={pp} x pipeline.virtual_stages={p.virtual_stages} = {num_stages} stages"
    if p.split_points:
        starts = []
        for point in p.split_points:
            prefix, _, idx = point.partition(".")
            if prefix != "layers" or not idx.isdigit() or not 0 < int(idx) < n_layers:
                raise ConfigError(
                    f"pipeline.split_points entry {point!r} names no module a stage can start "
                    f"at: use 'layers.N' with 0 < N < {n_layers} (the model's decoder layers)"
                )
            starts.append(int(idx))
        if len(starts) != num_stages - 1:
            raise ConfigError(
                f"pipeline.split_points has {len(starts)} entries but {how} need "
                f"{num_stages - 1}: give one split point per stage boundary"
            )
        if starts != sorted(set(starts)):
            raise ConfigError(
                f"pipeline.split_points {p.split_points} must be strictly increasing "
                "(every stage needs at least one decoder layer)"
            )
    elif p.layers_per_stage:
        k = p.layers_per_stage
        got = -(-n_layers // k)
        if got != num_stages:
            raise ConfigError(
                f"pipeline.layers_per_stage={k} splits {n_layers} layers into {got} stages, but "
                f"{how}: choose layers_per_stage so that ceil(n_layers / layers_per_stage) = "
                f"{num_stages}, or set pipeline.split_points"
            )
        starts = list(range(k, n_layers, k))
    else:
        if n_layers % num_stages:
            raise ConfigError(
                f"{n_layers} decoder layers do not split evenly into {how}: change pp or "
                "pipeline.virtual_stages, or set pipeline.layers_per_stage or "
                "pipeline.split_points (uneven stages)"
            )
        k = n_layers // num_stages
        starts = list(range(k, n_layers, k))
    bounds = [0, *starts, n_layers]
    layers = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return StagePlan(layers, stage_ranks(num_stages, pp, p.schedule))


def prune_to_stage(model: nn.Module, plan: StagePlan, stage: int) -> nn.Module:
    """A deep copy of the (meta) model holding only stage `stage`'s part."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in plan.layers[stage]}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != plan.num_stages - 1:
        part.norm = None
        part.output = None
    return part


def split_stages(
    model: nn.Module, cfg: JobConfig, dims: ParallelDims
) -> tuple[StagePlan, list[int], list[nn.Module]]:
    """The plan, this rank's stage indices and their (meta, unparallelised) modules."""
    sparse = table_optimizer_spec(cfg.optimizer.table_optimizer).row_sparse
    if cfg.pipeline.schedule in SPLIT_BACKWARD and cfg.engram.enabled and sparse:
        # The row-sparse lookup returns no weight gradient (engram/models/table_grad.py), and the
        # weight-gradient step of these schedules asks autograd for one: torch fails there.
        raise ConfigError(
            f"pipeline.schedule={cfg.pipeline.schedule} computes weight gradients in a separate "
            f"pass that row-sparse Engram tables (optimizer.table_optimizer="
            f"{cfg.optimizer.table_optimizer}) do not support: use optimizer.table_optimizer = "
            '"adam", or a schedule without split backward (GPipe, 1F1B, Interleaved1F1B, '
            "LoopedBFS)"
        )
    if model.args.tie_embeddings:
        raise ConfigError(
            "tied input/output embeddings cannot be split across pipeline stages (the embedding "
            "is on the first stage, the output head on the last): set parallelism.pp = 1"
        )
    plan = plan_stages(model.args.n_layers, cfg.pipeline, dims.pp)
    local = plan.local_stages(dims.mesh("pp").get_local_rank())
    return plan, local, [prune_to_stage(model, plan, s) for s in local]


class _Stage(PipelineStage):
    """torch's PipelineStage, whose metadata forward is not one of the step's table lookups.

    When a schedule (re)initialises its stages (its first step, and a switch between eval and
    train) torch runs each stage's forward once more on micro-batch 0, to infer the shapes it
    sends (and a backward of it for the gradients' shapes); host / NVMe tables look that
    forward's rows up when it runs, off their prefetch queues (parallelisms/table_prefetch.py
    queues the step's real lookups only), and Engram blocks record no log-step statistics
    (engram/models/engram_stats.py). If a torch version infers elsewhere, the first real lookup
    finds its ids differ from its queue's head and fails naming the prefetch (never rows of
    other ids)."""

    def _prepare_forward_infra(self, *args, **kwargs):
        with lookups_off_queue(), engram_stats.paused():  # nor one of the step's statistics
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args, **kwargs):
        # torch infers the gradients' shapes by a backward of that same forward: with activation
        # checkpointing it recomputes the forward, which must see the channel as the forward
        # did (closed) or torch.compile picks the log-step graph and the recompute's saved
        # tensors differ from the forward's (CheckpointError)
        with engram_stats.paused():
            return super()._prepare_backward_infra(*args, **kwargs)


def build_schedule(
    parts: list[nn.Module],
    stage_ids: list[int],
    plan: StagePlan,
    cfg: JobConfig,
    dims: ParallelDims,
    device: torch.device,
    loss_fn,
    n_micro: int,
) -> _PipelineSchedule:
    """The torch schedule over this rank's stages, `n_micro` micro-batches per step (from
    check_schedule). `loss_fn(output, labels)` runs on the last stage per micro-batch; grads are
    not rescaled by torch (scale_grads=False): the loss_fn carries the
    1 / (micro-batches x accumulation steps) factor itself."""
    pp_mesh = dims.mesh("pp")

    def get_mesh(names, _layout):  # DTensor activations (TP) between stages: the stage's meshes
        return dims.mesh(names[0]) if len(names) == 1 else dims.mesh("world")[names]

    stages = [
        _Stage(part, s, plan.num_stages, device, group=pp_mesh.get_group(), get_mesh=get_mesh)
        for part, s in zip(parts, stage_ids, strict=True)
    ]
    cls = get_schedule_class(cfg.pipeline.schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)


def build_eval_schedule(
    parts: list[nn.Module],
    stage_ids: list[int],
    plan: StagePlan,
    dims: ParallelDims,
    device: torch.device,
    loss_fn,
    train_schedule: _PipelineSchedule,
    n_micro: int,
) -> _PipelineSchedule:
    """A forward-only schedule for the held-out loss (call its .eval()).

    Single-stage schedules evaluate with the training schedule itself. torch's multi-stage
    schedules execute their precomputed action list, backward actions included, even in eval(),
    so for them this builds the same schedule class over fresh stage objects (same modules) and
    keeps only the forward part of its order: forward compute, its sends / receives, FSDP
    unshard / reshard. A forward never waits on a backward, so the subsequence of a valid order
    cannot deadlock."""
    if isinstance(train_schedule, PipelineScheduleSingle):
        return train_schedule
    pp_group = dims.mesh("pp").get_group()
    stages = [
        _Stage(part, s, plan.num_stages, device, group=pp_group)
        for part, s in zip(parts, stage_ids, strict=True)
    ]
    schedule = type(train_schedule)(
        stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False
    )
    keep = {
        _ComputationType.FORWARD,
        _ComputationType.SEND_F,
        _ComputationType.RECV_F,
        _ComputationType.UNSHARD,
        _ComputationType.RESHARD,
    }
    order = schedule.pipeline_order_with_comms
    for rank, actions in order.items():
        flat = [sub for a in actions for sub in (a.sub_actions or (a,))]
        order[rank] = [a for a in flat if a.computation_type in keep]
    return schedule
