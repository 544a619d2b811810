"""The meta model placed on this rank for recipes/train.py: pipeline stages (under PP), each
parallelised in parallelize.py's order, materialised and initialised; the loss over them and,
under PP, the schedules that run them.

It lives in runner/ because it assembles a run from the placement code (split_stages,
parallelize_model, the host-memory check and the start-up checks, the schedule builders), while the pieces it returns
(LanguageModelLoss, PipelineRun) are engram/train's: runner/ imports parallelisms/ and engram/,
never the reverse.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from engram.config import JobConfig
from engram.rowstore.nvme_checks import check_nvme_settings
from engram.train.loss import LanguageModelLoss, build_loss
from engram.train.metrics import logger
from engram.train.step import PipelineLoss, PipelineRun
from parallelisms.engram_tables import check_host_memory, mem_available_bytes
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_model
from parallelisms.pipeline import (
    StagePlan,
    build_eval_schedule,
    build_schedule,
    check_schedule,
    split_stages,
)
from runner.start_checks import refuse_at_start, report_tiers


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds (a DTensor's numel() is its global size)."""
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def build_model_parts(
    model: nn.Module, cfg: JobConfig, dims: ParallelDims, device: torch.device
) -> tuple[list[nn.Module], LanguageModelLoss, PipelineRun | None]:
    """This rank's model parts (one part; under PP its stages, each split from the meta model
    first and then parallelised), materialised on `device` and initialised (init is
    independent of the layout); the loss; the PipelineRun under PP, else None."""
    model_parts = [model]
    if dims.pp_enabled:
        plan, stage_ids, model_parts = split_stages(model, cfg, dims)
        logger.info(f"pipeline: stages {stage_ids} of {plan.layers} on this rank")
    for part in model_parts:
        parallelize_model(part, cfg, dims)
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cfg.engram.enabled and cfg.engram.table_location == "nvme":  # before any page file
        e = cfg.engram
        check_nvme_settings(
            e.nvme_dirs, e.nvme_create_dirs, e.nvme_host_cache_gib, ranks_per_node,
            mem_available_bytes(),
        )  # fmt: skip
    # Host tables (engram.table_location = host) must fit the node's memory: checked on meta.
    check_host_memory(
        model_parts,
        cfg.optimizer.table_optimizer,
        ranks_per_node,
        cfg.engram.host_memory_gib,
    )
    # What would fail hours later (drive space, async-save host memory, the checkpoint folder)
    # is refused now, by the planner's rules: runner/start_checks.py.
    refuse_at_start(model_parts, cfg, dims, device)
    for part in model_parts:
        part.to_empty(device=device)  # host tables materialise on the host
        part.init_weights(seed=cfg.job.seed)  # requires_grad: set by parallelize_model
    report_tiers(model_parts, cfg)  # host / NVMe tables: a line per rank, the drive probe
    # One loss for every forward path (see engram/train/loss.py); TP loss parallel keeps the
    # logits sharded over the vocabulary (see tensor_parallel.py).
    sharded_logits = dims.tp_enabled and cfg.parallelism.tp_loss_parallel
    loss_fn = build_loss(cfg.training.loss_chunks, model_parts, sharded_logits)
    n_params = sum(local_numel(p) for part in model_parts for p in part.parameters())
    logger.info(
        f"model {cfg.model.name}/{cfg.model.flavor}: {n_params:,} local parameters on this rank"
    )
    pp = None
    if dims.pp_enabled:
        pp = build_pipeline_run(model_parts, stage_ids, plan, cfg, dims, device, loss_fn)
    return model_parts, loss_fn, pp


def build_pipeline_run(
    model_parts: list[nn.Module],
    stage_ids: list[int],
    plan: StagePlan,
    cfg: JobConfig,
    dims: ParallelDims,
    device: torch.device,
    loss_fn: LanguageModelLoss,
) -> PipelineRun:
    """The training and evaluation schedules over this rank's (materialised) stages."""
    if not all(any(p.requires_grad for p in part.parameters()) for part in model_parts):
        raise ValueError(
            f"training.mode={cfg.training.mode!r} leaves a pipeline stage without trainable "
            "parameters (no Engram layer on it): put an Engram layer on every stage "
            "(engram.layer_ids / pipeline.split_points) or train with mode = 'full'"
        )
    pp_loss = PipelineLoss(loss_fn)
    microbatches = check_schedule(cfg.pipeline, dims.pp, cfg.training.local_batch_size)
    schedule = build_schedule(
        model_parts, stage_ids, plan, cfg, dims, device, pp_loss, microbatches
    )
    pp_group = dims.mesh("pp").get_group()
    return PipelineRun(
        schedule=schedule,
        eval_schedule=build_eval_schedule(
            model_parts, stage_ids, plan, dims, device, pp_loss, schedule, microbatches
        ),
        microbatches=microbatches,
        loss=pp_loss,
        has_first_stage=0 in stage_ids,
        group=pp_group,
        last_stage_rank=dist.get_global_rank(pp_group, plan.last_stage_rank),
    )
