"""Train a dense LLM with Engram memory. Copy this file and edit it; it reads top to bottom.

    CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh [--section.key=value ...]

The parallelisms are applied in the order stated in parallelisms/parallelize.py; then the model
is materialised and initialised (init is independent of the layout). The model is held as
`model_parts` (one part; under pipeline parallelism this rank's stages, each split from the meta
model first and then parallelised) and one optimizer step is `forward_backward` per micro-batch
(under PP: `pipeline_forward_backward`, one schedule.step per accumulation step), then clip, step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from engram.checkpoint import CheckpointManager, ModelState, OptimizerState, TrainState
from engram.checkpoint.fingerprint import config_fingerprint
from engram.config import JobConfig, load_config
from engram.data.loader import build_dataloader
from engram.data.tokenizer import load_tokenizer
from engram.hf.load import load_frozen_backbone, load_hf_backbone
from engram.models.builder import build_hasher, build_model_from_config
from engram.optim.builder import (
    SchedulersState,
    build_lr_schedulers,
    build_optimizers,
    clip_grad_norm_,
    saved_params,
    scheduled_lr,
)
from engram.runtime import device as dev
from engram.runtime.distributed import destroy_distributed, init_distributed
from engram.runtime.host_worker import wait_host_work
from engram.train.loss import LanguageModelLoss, build_loss, local_value
from engram.train.metrics import MetricsLogger, init_logger, logger
from engram.train.nonfinite import NonFiniteGuard
from engram.train.profiling import maybe_profile
from engram.train.table_check import warn_if_tables_collide
from parallelisms.engram_tables import check_host_memory, prefetch_host_tables
from parallelisms.fsdp import defer_grad_sync
from parallelisms.parallel_dims import parallel_dims_from_config
from parallelisms.parallelize import parallelize_model
from parallelisms.pipeline import build_eval_schedule, build_schedule, check_schedule, split_stages


@dataclass
class TrainResult:
    """What a run leaves behind in memory (tests and notebooks use it; files are the real record)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    model: torch.nn.Module | None = None
    model_parts: list[torch.nn.Module] = field(default_factory=list)  # this rank's stages under PP
    start_step: int = 0


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds (a DTensor's numel() is its global size)."""
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def forward_backward(
    model_parts: list[nn.Module],
    batch: dict[str, torch.Tensor],
    loss_fn: LanguageModelLoss,
    loss_scale: float,
) -> torch.Tensor:
    """One micro-batch: forward, loss, backward of `loss * loss_scale`; returns the detached
    loss. Hash ids go by keyword so a pipeline schedule can forward them to every stage."""
    (model,) = model_parts  # pp = 1: one part
    output = model(batch["input_ids"], hash_ids=batch.get("hash_ids"))
    loss = loss_fn(output, batch["labels"])
    (loss * loss_scale).backward()
    return local_value(loss)


class PipelineLoss:
    """The last stage's loss per micro-batch, times `scale`. torch does not rescale pipeline
    grads (scale_grads=False): scale = 1 / (micro-batches x accumulation steps) makes the
    gradients those of the mean loss over the local batch, as without PP."""

    def __init__(self, loss_fn: LanguageModelLoss) -> None:
        self.loss_fn = loss_fn
        self.scale = 1.0

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, labels) * self.scale


@dataclass
class PipelineRun:
    """This rank's pipeline schedules and where the loss lives (under PP only)."""

    schedule: Any  # a torch.distributed.pipelining schedule over this rank's stages
    eval_schedule: Any  # forward-only (see parallelisms/pipeline.py build_eval_schedule)
    microbatches: int  # per schedule step
    loss: PipelineLoss
    has_first_stage: bool  # feeds input_ids
    group: dist.ProcessGroup  # the pp group
    last_stage_rank: int  # global rank holding the last stage (it computes the loss)

    def broadcast_loss(self, value: torch.Tensor) -> None:
        dist.broadcast(value, src=self.last_stage_rank, group=self.group)


def pipeline_forward_backward(
    pp: PipelineRun, batch: dict[str, torch.Tensor], loss_scale: float, train: bool = True
) -> torch.Tensor:
    """One local batch through the pipeline schedule (split into micro-batches by torch).
    Returns the mean loss over the batch on the rank holding the last stage, 0 elsewhere.
    Hash ids go by keyword: torch splits them along dim 0 and gives every stage its slice."""
    schedule = pp.schedule if train else pp.eval_schedule
    pp.loss.scale = loss_scale / pp.microbatches
    args = (batch["input_ids"],) if pp.has_first_stage else ()
    kwargs = {"hash_ids": batch["hash_ids"]} if "hash_ids" in batch else {}
    losses: list[torch.Tensor] = []
    run = schedule.step if train else schedule.eval
    run(*args, target=batch["labels"], losses=losses, **kwargs)
    if not losses:
        return torch.zeros((), device=batch["labels"].device)
    return sum(local_value(x) for x in losses) / loss_scale


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def dp_mean(value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Mean of a per-rank scalar over the data-parallel ranks, on the device (no host read)."""
    value = value.detach().float().clone()
    dist.all_reduce(value, group=group)
    return value / dist.get_world_size(group)


@torch.no_grad()
def evaluate(model_parts, loader, num_batches: int, device, dp_group, loss_fn, pp=None) -> float:
    """Held-out loss (`pp`: the PipelineRun under pipeline parallelism; its loss is loss_fn)."""
    for part in model_parts:
        part.eval()
    total = torch.zeros((), device=device)
    it = iter(loader)
    for _ in range(num_batches):
        batch = to_device(next(it), device)
        if pp is not None:
            total += pipeline_forward_backward(pp, batch, 1.0, train=False)
            continue
        (model,) = model_parts
        output = model(batch["input_ids"], hash_ids=batch.get("hash_ids"))
        total += local_value(loss_fn(output, batch["labels"]))
    for part in model_parts:
        part.train()
    if pp is not None:
        pp.broadcast_loss(total)
    return dp_mean(total / num_batches, dp_group).item()


def train(cfg: JobConfig) -> TrainResult:
    # --- devices and process groups -------------------------------------------------------
    device_type = dev.resolve_device_type(cfg.job.device)
    dev.import_device_backend(device_type)
    dev.apply_device_env(device_type, cfg.job.deterministic)  # npu only; before HCCL starts
    rank, local_rank, world_size = init_distributed(device_type)
    device = dev.local_device(device_type, local_rank)
    init_logger(rank)
    dims = parallel_dims_from_config(cfg, world_size)
    dev.warn_npu_gaps(device_type, dims.tp, dims.pp)
    dims.build_mesh(device_type)
    dp_mesh = dims.mesh("dp")
    dp_rank, dp_group = dp_mesh.get_local_rank(), dp_mesh.get_group()
    if cfg.job.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.job.seed)
    logger.info(f"world {world_size} on {device_type}: {dims}")

    # --- tokenizer, Engram hashing, model on meta -----------------------------------------
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    # The hasher feeds the data loader; the model needs only the table sizes (from the config).
    hasher = build_hasher(cfg, tokenizer)
    model = build_model_from_config(cfg, tokenizer.vocab_size)
    if hasher is not None:
        logger.info(f"Engram hashing: {hasher}")
        warn_if_tables_collide(hasher)

    # --- pipeline stages (PP), then the parallelisms of each, in the documented order -------
    model_parts = [model]
    if dims.pp_enabled:
        plan, stage_ids, model_parts = split_stages(model, cfg, dims)
        logger.info(f"pipeline: stages {stage_ids} of {plan.layers} on this rank")
    for part in model_parts:
        parallelize_model(part, cfg, dims)
    # Host tables (engram.table_location = host) must fit the node's memory: checked on meta.
    check_host_memory(
        model_parts,
        cfg.optimizer.table_optimizer,
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        cfg.engram.host_memory_gib,
    )
    for part in model_parts:
        part.to_empty(device=device)  # host tables materialise on the host
        part.init_weights(seed=cfg.job.seed)  # requires_grad: set by parallelize_model
    model = model_parts[0]
    # One loss for every forward path (see engram/train/loss.py); TP loss parallel keeps the logits
    # sharded over the vocabulary (see tensor_parallel.py).
    sharded_logits = dims.tp_enabled and cfg.parallelism.tp_loss_parallel
    loss_fn = build_loss(cfg.training.loss_chunks, model_parts, sharded_logits)
    n_params = sum(local_numel(p) for part in model_parts for p in part.parameters())
    logger.info(
        f"model {cfg.model.name}/{cfg.model.flavor}: {n_params:,} local parameters on this rank"
    )

    pp: PipelineRun | None = None
    if dims.pp_enabled:
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
        pp = PipelineRun(
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

    # One optimizer set per stage (their parameters are disjoint); DCP sees them as one model.
    part_optimizers = [build_optimizers(part, cfg) for part in model_parts]
    optimizers = [opt for opts in part_optimizers for opt in opts]
    schedulers = build_lr_schedulers(optimizers, cfg)
    train_loader = build_dataloader(cfg, tokenizer, hasher, dp_rank, dims.dp_size, split="train")

    # A fresh held-out loader per evaluation scores the same batches every time.
    def make_eval_loader():
        return build_dataloader(cfg, tokenizer, hasher, dp_rank, dims.dp_size, split="val")

    # --- run folder: checkpoints, then metrics, TensorBoard ---------------------------------
    state = TrainState()
    checkpointer = CheckpointManager(
        cfg.checkpoint,
        cfg.run_folder,
        states={
            "model": ModelState(model_parts, keep=saved_params(cfg)),
            "optimizer": OptimizerState(model_parts, part_optimizers),
            "lr_scheduler": SchedulersState(schedulers),
            "dataloader": train_loader,
            "train_state": state,
        },
        fingerprint=config_fingerprint(cfg, tokenizer, hasher),
        data_meta={
            "global_batch_samples": cfg.training.local_batch_size
            * cfg.training.grad_accum_steps
            * dims.dp_size,
            "seq_len": cfg.training.seq_len,
        },
    )
    # A trainable-only checkpoint holds no backbone: read first, a resume overwrites what trains.
    hf_first = any([load_frozen_backbone(part, cfg) for part in model_parts])
    start_step = checkpointer.load()
    # Only now: a refused resume must leave the run folder's config record untouched.
    metrics = MetricsLogger(cfg.run_folder, cfg.metrics, rank, config_dict=cfg.to_dict())
    guard = NonFiniteGuard(cfg.training.max_nonfinite_steps, checkpointer.last_good_checkpoint)
    if cfg.model.hf_checkpoint and start_step == 0:  # a resumed run has its weights already
        if cfg.engram.enabled and cfg.engram.init != "identity":
            logger.warning(
                "engram.init is not 'identity': the pretrained function changes at step 0"
            )
        for part in model_parts if not hf_first else ():  # under PP each stage its own layers
            load_hf_backbone(part, cfg.model.hf_checkpoint, model.args)
    result = TrainResult(start_step=start_step, model=model, model_parts=model_parts)

    # --- the loop ---------------------------------------------------------------------------
    # Host reads (.item(), device synchronisation) happen on log steps only, plus the guard's
    # one finiteness check per step (engram/train/nonfinite.py): a host sync every step would stall
    # an accelerator's queue. Per-step values stay on the device until the end of the run.
    tokens_per_step = (
        cfg.training.local_batch_size * cfg.training.seq_len * cfg.training.grad_accum_steps
    )
    data_iter = iter(train_loader)
    trainable = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    # Host tables see hash_ids[:, :, slot] only without TP / PP; there their lookups gather late.
    prefetch = (
        cfg.engram.enabled
        and cfg.engram.table_location == "host"
        and not (dims.tp_enabled or dims.pp_enabled)
    )
    step_losses: list[torch.Tensor] = []  # global mean loss per step, on the device
    step_grad_norms: list[torch.Tensor] = []
    dev.reset_peak_memory(device)
    window_start, window_steps = time.perf_counter(), 0
    # One loss context (TP loss parallel) around every forward path: train, pipeline, eval.
    with (
        loss_fn.context(),
        maybe_profile(
            cfg.profiling, cfg.run_folder, rank, device_type=device_type, start_step=start_step
        ) as profiler,
    ):
        for step in range(start_step + 1, cfg.training.steps + 1):
            last_step = step == cfg.training.steps
            log_step = step % cfg.metrics.log_freq == 0 or last_step
            loss_sum = torch.zeros((), device=device)
            # This step's micro-batches up front: host tables prefetch their rows (behind the
            # previous step's host update; see parallelisms/host_tables.py).
            batches = [
                to_device(next(data_iter), device) for _ in range(cfg.training.grad_accum_steps)
            ]
            if prefetch:
                for batch in batches:
                    prefetch_host_tables(model, batch["hash_ids"])
            for micro, batch in enumerate(batches):
                last_micro = micro == cfg.training.grad_accum_steps - 1
                if pp is not None:  # the schedule toggles FSDP's reduction itself
                    loss_sum += pipeline_forward_backward(
                        pp, batch, 1.0 / cfg.training.grad_accum_steps
                    )
                    continue
                # DDP reduces once per optimizer step; FSDP/HSDP every micro-batch (see fsdp.py).
                if defer_grad_sync(dims):
                    for part in model_parts:
                        part.set_requires_gradient_sync(last_micro)
                loss_sum += forward_backward(
                    model_parts, batch, loss_fn, 1.0 / cfg.training.grad_accum_steps
                )
            if pp is not None:  # the loss lives on the last stage
                pp.broadcast_loss(loss_sum)
            grad_norm = clip_grad_norm_(
                trainable,
                cfg.training.max_norm,
                pp_group=dims.mesh("pp").get_group() if dims.pp_enabled else None,
            )
            loss = dp_mean(loss_sum / cfg.training.grad_accum_steps, dp_group)
            grad_norm = grad_norm.detach().float().to(loss.device)
            skip = guard.skip(step, torch.stack([loss, grad_norm]))  # before any update
            applied_lr = scheduled_lr(schedulers[0], cfg.optimizer.lr)  # this update's
            for opt in optimizers:
                if not skip:
                    opt.step()
                opt.zero_grad(set_to_none=True)
            for sched in schedulers:
                sched.step()
            profiler.step()
            state.step = step
            state.tokens_seen += tokens_per_step * dims.dp_size
            step_losses.append(loss)
            step_grad_norms.append(grad_norm)
            window_steps += 1
            if log_step:
                dev.synchronize(device)
                dt = (time.perf_counter() - window_start) / window_steps
                mem = dev.memory_stats(device)
                metrics.log(
                    step,
                    {
                        "loss": loss.item(),
                        "lr": applied_lr,
                        "grad_norm": grad_norm.item(),
                        "tokens_per_s": tokens_per_step * dims.dp_size / dt,
                        "step_time_s": dt,  # mean over the steps since the last log
                        "tokens_seen": state.tokens_seen,
                        "nonfinite_steps": guard.total,
                        **{f"mem_{k}": v for k, v in mem.items()},
                        # data: global tokens consumed per mixture source (tokens dataset)
                        **{
                            f"data_tokens/{name}": n * cfg.training.seq_len
                            for name, n in train_loader.samples_per_source().items()
                        },
                    },
                )
            if cfg.data.eval_batches > 0 and (
                (cfg.data.eval_every and step % cfg.data.eval_every == 0) or last_step
            ):
                eval_loss = evaluate(
                    model_parts,
                    make_eval_loader(),
                    cfg.data.eval_batches,
                    device,
                    dp_group,
                    loss_fn,
                    pp,
                )
                result.eval_losses[step] = eval_loss
                metrics.log(step, {"eval_loss": eval_loss})
            # Never at a skipped step: a save there could prune the last good checkpoint.
            checkpointer.maybe_save(step, last_step=last_step, finite=not skip)
            if log_step:
                window_start, window_steps = time.perf_counter(), 0
    wait_host_work()  # the last host-table update
    result.losses = torch.stack(step_losses).tolist() if step_losses else []
    result.grad_norms = torch.stack(step_grad_norms).tolist() if step_grad_norms else []
    metrics.close()
    guard.check_finished(cfg.training.steps)
    return result


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(argv)
    try:
        train(cfg)
        # Every rank leaves the last collective before any rank tears its process groups down.
        dist.barrier()
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
