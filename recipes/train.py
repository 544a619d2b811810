"""Train a dense LLM with Engram memory. Copy this file and edit it; it reads top to bottom.

    CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh [--section.key=value ...]

The model is built on meta, then placed on this rank by parallelisms/model_parts.py: the
parallelisms in the order stated in parallelisms/parallelize.py, then materialised and
initialised (init is independent of the layout). It is held as `model_parts` (one part; under
pipeline parallelism this rank's stages, each split from the meta model first and then
parallelised). One optimizer step: the data, `forward_backward` per micro-batch (under PP:
`pipeline_forward_backward`, one schedule.step per accumulation step), clip, the
non-finite guard, the update, log, evaluate, save. The pieces are engram/train/ (build.py,
step.py, evaluate.py, progress.py), shared with recipes/train_deepspeed.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engram.checkpoint import ModelState, OptimizerState, TrainState
from engram.config import JobConfig, load_config
from engram.hf.load import load_frozen_backbone, load_hf_at_start
from engram.optim.builder import (
    SchedulersState,
    build_lr_schedulers,
    build_optimizers,
    clip_grad_norm_,
    saved_params,
    scheduled_lr,
)
from engram.runtime import device as dev
from engram.runtime.distributed import destroy_distributed, set_pg_timeouts
from engram.runtime.host_worker import wait_host_work
from engram.train.build import (
    build_checkpointer,
    build_loaders,
    build_meta_model,
    init_process,
)
from engram.train.evaluate import eval_due, evaluate
from engram.train.flops import model_flops
from engram.train.metrics import MetricsLogger, logger
from engram.train.nonfinite import NonFiniteGuard
from engram.train.profiling import maybe_profile
from engram.train.progress import Progress, TrainResult
from engram.train.step import (
    dp_mean,
    forward_backward,
    next_batches,
    pipeline_forward_backward,
    step_optimizers,
)
from engram.train.throughput import Throughput
from parallelisms.context_parallel import split_batch
from parallelisms.engram_tables import prefetch_host_tables
from parallelisms.fsdp import defer_grad_sync
from parallelisms.model_parts import build_model_parts
from parallelisms.parallel_dims import parallel_dims_from_config


def train(cfg: JobConfig) -> TrainResult:
    # --- devices and process groups -------------------------------------------------------
    proc = init_process(cfg)
    device = proc.device
    dims = parallel_dims_from_config(cfg, proc.world_size)
    dev.warn_npu_gaps(proc.device_type, dims.tp, dims.pp)
    dims.build_mesh(proc.device_type)
    dp_mesh = dims.mesh("dp")  # the loader's rank space: the cp ranks of a replica share a sample
    dp_rank = dp_mesh.get_local_rank()
    dp_group = dims.mesh("dp_cp").get_group()  # every rank with other tokens: the logged loss
    logger.info(f"world {proc.world_size} on {proc.device_type}: {dims}")

    # --- tokenizer, Engram hashing, model on meta; then placed on this rank -----------------
    # (pipeline stages under PP, each parallelised in the order of parallelisms/parallelize.py,
    # materialised and initialised; the one loss of every forward path; the PP schedules)
    tokenizer, hasher, model = build_meta_model(cfg)
    flops = model_flops(model, cfg)  # of the whole model, before placement (engram/train/flops.py)
    model_parts, loss_fn, pp = build_model_parts(model, cfg, dims, device)
    model = model_parts[0]

    # --- optimizers (one set per stage: their parameters are disjoint), schedules, data -------
    part_optimizers = [build_optimizers(part, cfg) for part in model_parts]
    optimizers = [opt for opts in part_optimizers for opt in opts]
    schedulers = build_lr_schedulers(optimizers, cfg)
    train_loader, make_eval_loader = build_loaders(cfg, tokenizer, hasher, dp_rank, dims.dp_size)

    # --- run folder: checkpoints, then metrics, TensorBoard ---------------------------------
    state = TrainState()
    states = {
        "model": ModelState(model_parts, keep=saved_params(cfg)),
        "optimizer": OptimizerState(model_parts, part_optimizers),
        "lr_scheduler": SchedulersState(schedulers),
        "dataloader": train_loader,
        "train_state": state,
    }
    checkpointer = build_checkpointer(cfg, tokenizer, hasher, dims.dp_size, states)
    # A trainable-only checkpoint holds no backbone: read first, a resume overwrites what trains.
    hf_first = any([load_frozen_backbone(part, cfg) for part in model_parts])
    start_step = checkpointer.load()
    # Only now: a refused resume must leave the run folder's config record untouched.
    metrics = MetricsLogger(cfg.run_folder, cfg.metrics, proc.rank, config_dict=cfg.to_dict())
    guard = NonFiniteGuard(cfg.training.max_nonfinite_steps, checkpointer.last_good_checkpoint)
    load_hf_at_start(model_parts, cfg, start_step, frozen_read=hf_first)
    result = TrainResult(start_step=start_step, model=model, model_parts=model_parts)

    # --- the loop ---------------------------------------------------------------------------
    accum = cfg.training.grad_accum_steps
    data_iter = iter(train_loader)
    trainable = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    pp_group = dims.mesh("pp").get_group() if dims.pp_enabled else None
    # Host / NVMe tables see hash_ids[:, :, slot] only without TP / PP; there their lookups
    # gather late.
    prefetch = (
        cfg.engram.enabled
        and cfg.engram.table_location != "device"
        and not (dims.tp_enabled or dims.pp_enabled)
    )
    profile = maybe_profile(cfg.profiling, cfg.run_folder, proc.rank, proc.device_type, start_step)
    throughput = Throughput(flops, device, proc.world_size, cfg.metrics.peak_tflops)
    progress = Progress(cfg, dims.dp_size, state, metrics, train_loader, device, throughput)
    # One loss context (TP loss parallel) around every forward path: train, pipeline, eval.
    with loss_fn.context(), profile as profiler:
        for step in range(start_step + 1, cfg.training.steps + 1):
            # data: this step's micro-batches up front; host tables prefetch their rows (behind
            # the previous step's host update; see parallelisms/engram_tables/host.py)
            with progress.data_timer():
                batches = next_batches(data_iter, accum, device)
            # context parallel: this rank's chunks of each sample (the whole batch at cp = 1)
            batches = [split_batch(batch, dims) for batch in batches]
            if prefetch:
                for batch in batches:
                    prefetch_host_tables(model, batch["hash_ids"])
            # forward / backward, per micro-batch
            loss_sum = torch.zeros((), device=device)
            for micro, batch in enumerate(batches):
                if pp is not None:  # the schedule toggles FSDP's reduction itself
                    loss_sum += pipeline_forward_backward(pp, batch, 1.0 / accum)
                    continue
                # DDP reduces once per optimizer step; FSDP/HSDP every micro-batch (see fsdp.py).
                if defer_grad_sync(dims):
                    for part in model_parts:
                        part.set_requires_gradient_sync(micro == accum - 1)
                loss_sum += forward_backward(model_parts, batch, loss_fn, 1.0 / accum)
            if pp is not None:  # the loss lives on the last stage
                pp.broadcast_loss(loss_sum)
            # clip, guard (before any update), update
            grad_norm = clip_grad_norm_(trainable, cfg.training.max_norm, pp_group=pp_group)
            loss = dp_mean(loss_sum / accum, dp_group)
            grad_norm = grad_norm.detach().float().to(loss.device)
            skip = guard.skip(step, torch.stack([loss, grad_norm]))
            applied_lr = scheduled_lr(schedulers[0], cfg.optimizer.lr)  # this update's
            step_optimizers(optimizers, schedulers, skip)
            profiler.step()
            # log, evaluate, save
            progress.record(step, loss, grad_norm, applied_lr, guard.total)
            if eval_due(cfg, step):
                result.eval_losses[step] = evaluate(
                    model_parts, make_eval_loader(), cfg.data.eval_batches, device, dp_group,
                    loss_fn, pp, prepare=lambda b: split_batch(b, dims),
                )  # fmt: skip
                metrics.log(step, {"eval_loss": result.eval_losses[step]})
            # Never at a skipped step: a save there could prune the last good checkpoint.
            last_step = step == cfg.training.steps
            checkpointer.maybe_save(step, last_step=last_step, finite=not skip)
            progress.end_step(step)
            if step == start_step + 1:  # start-up is over (load, compile, first step): [comm]
                set_pg_timeouts(cfg.comm.train_timeout_s)
    wait_host_work()  # the last host-table update
    result.losses, result.grad_norms = progress.history()
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
