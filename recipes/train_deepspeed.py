"""Train with DeepSpeed ZeRO-1/2/3: recipes/train.py with the dense model under a DeepSpeed engine.

    TRAIN_SCRIPT=recipes/train_deepspeed.py CONFIG_FILE=train_configs/debug_model.toml \
        NGPU=2 ./run_train.sh --deepspeed.zero_stage=3

It reads the same TOML plus the [deepspeed] section (docs/deepspeed.md) and is built from the
same pieces as train.py (engram/train/: process, meta model, data, checkpoint manager, step,
metrics, evaluation). What differs, and so is here: the model is placed for the engine
(runner/deepspeed_engine.py place_for_engine: LoRA as in train.py, the Engram tables
row-sharded as there, then taken out of the module tree, since ZeRO-3 would partition them, and
given their own optimizer); everything else (backbone, LoRA adapters, Engram gates /
projections / ShortConv) is handed to `deepspeed.initialize` with a torch AdamW. One optimizer
step: `engine.backward` per micro-batch, then one global gradient norm over engine + tables
(DeepSpeed's own clipping is off), the non-finite guard, `engine.step()` and the tables' step.
The step folder holds the engine's checkpoint and the tables' DCP shards, committed together.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engram.checkpoint import ModelState, OptimizerState, TrainState
from engram.config import JobConfig, load_config
from engram.optim.builder import (
    SchedulersState,
    build_lr_schedulers,
    build_optimizers,
    scheduled_lr,
)
from engram.runtime import device as dev
from engram.runtime.distributed import destroy_distributed, set_pg_timeouts
from engram.train.build import build_checkpointer, build_loaders, build_meta_model, init_process
from engram.train.evaluate import eval_due, evaluate
from engram.train.flops import model_flops
from engram.train.loss import LanguageModelLoss, cross_entropy
from engram.train.metrics import MetricsLogger, logger
from engram.train.nonfinite import NonFiniteGuard
from engram.train.profiling import maybe_profile
from engram.train.progress import Progress, TrainResult
from engram.train.step import dp_mean, next_batches, step_optimizers
from engram.train.throughput import Throughput
from runner.deepspeed_engine import (
    EngineCheckpoint,
    build_ds_config,
    check_layout,
    clip_engine_and_tables_,
    engine_update_discarded,
    import_deepspeed,
    place_for_engine,
)
from parallelisms.parallel_dims import parallel_dims_from_config


@dataclass
class DeepSpeedResult(TrainResult):
    engine: Any = None  # the DeepSpeed engine (engine.module: the dense model)
    tables: nn.Module | None = None  # the row-sharded Engram tables, under their model names


def train(cfg: JobConfig) -> DeepSpeedResult:
    check_layout(cfg)
    deepspeed = import_deepspeed(dev.resolve_device_type(cfg.job.device))

    # --- devices and process groups (DeepSpeed joins the default group created there) -------
    proc = init_process(cfg)
    deepspeed.init_distributed(dist_backend=dev.dist_backend(proc.device_type))
    device, stage = proc.device, cfg.deepspeed.zero_stage
    dims = parallel_dims_from_config(cfg, proc.world_size)
    dims.build_mesh(proc.device_type)
    dp_mesh = dims.mesh("dp")
    dp_rank, dp_group = dp_mesh.get_local_rank(), dp_mesh.get_group()
    logger.info(f"world {proc.world_size} on {proc.device_type}: DeepSpeed ZeRO-{stage}")

    # --- model on meta, placed for the engine; the tables come out of its module tree -------
    tokenizer, hasher, model = build_meta_model(cfg)
    flops = model_flops(model, cfg)  # before the engine takes the model
    ds_config = build_ds_config(cfg, proc.world_size)
    tables = place_for_engine(model, cfg, dims, device, ds_config)

    # --- optimizers (a torch AdamW for the engine, the tables' own), engine, data -------------
    table_params = list(tables.parameters())
    (dense_optimizer,) = build_optimizers(model, cfg)
    table_optimizers = build_optimizers(tables, cfg) if table_params else []
    schedulers = build_lr_schedulers([dense_optimizer, *table_optimizers], cfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=dense_optimizer, config=ds_config)
    train_loader, make_eval_loader = build_loaders(cfg, tokenizer, hasher, dp_rank, dims.dp_size)

    # --- run folder: checkpoints (engine + table shards in one step folder), metrics ----------
    state = TrainState()
    states: dict[str, Any] = {
        "lr_scheduler": SchedulersState(schedulers),
        "dataloader": train_loader,
        "train_state": state,
    }
    if table_params:
        states["tables"] = ModelState(tables)
        states["table_optimizer"] = OptimizerState(tables, table_optimizers)
    checkpointer = build_checkpointer(
        cfg, tokenizer, hasher, dims.dp_size, states, engine=f"deepspeed-zero{stage}",
        folder_states={"engine": EngineCheckpoint(engine)},
    )  # fmt: skip
    start_step = checkpointer.load()
    metrics = MetricsLogger(cfg.run_folder, cfg.metrics, proc.rank, config_dict=cfg.to_dict())
    guard = NonFiniteGuard(cfg.training.max_nonfinite_steps, checkpointer.last_good_checkpoint)
    result = DeepSpeedResult(
        start_step=start_step, model=model, model_parts=[model], engine=engine, tables=tables
    )

    # --- the loop: train.py's step with the engine's forward / backward and update ------------
    accum = cfg.training.grad_accum_steps
    data_iter = iter(train_loader)
    eval_loss_fn = LanguageModelLoss(1, None, sharded_logits=False)
    profile = maybe_profile(cfg.profiling, cfg.run_folder, proc.rank, proc.device_type, start_step)
    throughput = Throughput(flops, device, proc.world_size, cfg.metrics.peak_tflops)
    progress = Progress(cfg, dims.dp_size, state, metrics, train_loader, device, throughput)
    with profile as profiler:
        for step in range(start_step + 1, cfg.training.steps + 1):
            # data, then forward / backward per micro-batch through the engine
            with progress.data_timer():
                batches = next_batches(data_iter, accum, device)
            loss_sum = torch.zeros((), device=device)
            for micro, batch in enumerate(batches):
                logits = engine(batch["input_ids"], hash_ids=batch.get("hash_ids"))
                loss = cross_entropy(logits, batch["labels"])
                engine.backward(loss)  # loss / accum; gradients reduced at the last micro-batch
                loss_sum += loss.detach()
                if micro < accum - 1:
                    engine.step()  # between boundaries DeepSpeed only counts the micro-batch
            # clip (one global norm over engine + tables), guard (before any update), update
            grad_norm = clip_engine_and_tables_(engine, table_params, cfg.training.max_norm)
            loss = dp_mean(loss_sum / accum, dp_group)
            grad_norm = grad_norm.detach().float().to(loss.device)
            skip = guard.skip(step, torch.stack([loss, grad_norm]))
            applied_lr = scheduled_lr(schedulers[0], cfg.optimizer.lr)
            # A skipped step skips the engine too, also when only the tables' gradients are
            # not finite (DeepSpeed would see finite gradients and apply its update).
            with engine_update_discarded(engine) if skip else nullcontext():
                engine.step()
            step_optimizers(table_optimizers, schedulers, skip)
            profiler.step()
            # log, evaluate, save
            progress.record(step, loss, grad_norm, applied_lr, guard.total)
            if eval_due(cfg, step):
                result.eval_losses[step] = evaluate(
                    [engine], make_eval_loader(), cfg.data.eval_batches, device, dp_group,
                    eval_loss_fn,
                )  # fmt: skip
                metrics.log(step, {"eval_loss": result.eval_losses[step]})
            last_step = step == cfg.training.steps
            checkpointer.maybe_save(step, last_step=last_step, finite=not skip)
            progress.end_step(step)
            if step == start_step + 1:  # start-up is over (load, compile, first step): [comm]
                set_pg_timeouts(cfg.comm.train_timeout_s)
    result.losses, result.grad_norms = progress.history()
    metrics.close()
    guard.check_finished(cfg.training.steps)
    return result


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(argv)
    try:
        train(cfg)
        dist.barrier()
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
