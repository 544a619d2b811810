"""Train with DeepSpeed ZeRO-1/2/3: recipes/train.py with the dense model under a DeepSpeed engine.

    TRAIN_SCRIPT=recipes/train_deepspeed.py CONFIG_FILE=train_configs/debug_model.toml \
        NGPU=2 ./run_train.sh --deepspeed.zero_stage=3

It reads the same TOML plus the [deepspeed] section (docs/deepspeed.md). What differs from
train.py: the Engram tables are row-sharded as there, then taken out of the module tree
(ZeRO-3 would partition them) and keep their own optimizer; everything else (backbone, Engram
gates / projections / ShortConv) is handed to `deepspeed.initialize` with a torch AdamW. One
optimizer step: `engine.backward` per micro-batch, then one global gradient norm over engine +
tables (DeepSpeed's own clipping is off), the non-finite guard, `engine.step()` and the tables'
step. The step folder holds the engine's checkpoint and the tables' DCP shards, committed together.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `recipes` under torchrun

from engram.checkpoint import CheckpointManager, ModelState, OptimizerState, TrainState  # noqa: E402
from engram.checkpoint.fingerprint import config_fingerprint  # noqa: E402
from engram.config import JobConfig, load_config  # noqa: E402
from engram.data.loader import build_dataloader  # noqa: E402
from engram.data.tokenizer import load_tokenizer  # noqa: E402
from engram.hf.load import load_hf_backbone, plan_hf_load  # noqa: E402
from engram.models.builder import build_hasher, build_model_from_config  # noqa: E402
from engram.optim.builder import (  # noqa: E402
    SchedulersState,
    apply_training_mode,
    build_lr_schedulers,
    build_optimizers,
    scheduled_lr,
)
from engram.runtime import device as dev  # noqa: E402
from engram.runtime.distributed import destroy_distributed, init_distributed  # noqa: E402
from engram.train.loss import LanguageModelLoss, cross_entropy  # noqa: E402
from engram.train.metrics import MetricsLogger, init_logger, logger  # noqa: E402
from engram.train.nonfinite import NonFiniteGuard  # noqa: E402
from engram.train.profiling import maybe_profile  # noqa: E402
from engram.train.table_check import warn_if_tables_collide  # noqa: E402
from parallelisms.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from parallelisms.deepspeed_engine import (  # noqa: E402
    EngineCheckpoint,
    build_ds_config,
    check_layout,
    clip_engine_and_tables_,
    detach_tables,
    engine_update_discarded,
    import_deepspeed,
    materialize_into_partitions,
)
from parallelisms.parallel_dims import parallel_dims_from_config  # noqa: E402
from parallelisms.parallelize import engram_halo, shard_engram_tables  # noqa: E402
from recipes.train import TrainResult, dp_mean, evaluate, to_device  # noqa: E402


@dataclass
class DeepSpeedResult(TrainResult):
    engine: Any = None  # the DeepSpeed engine (engine.module: the dense model)
    tables: nn.Module | None = None  # the row-sharded Engram tables, under their model names


def train(cfg: JobConfig) -> DeepSpeedResult:
    check_layout(cfg)
    device_type = dev.resolve_device_type(cfg.job.device)
    deepspeed = import_deepspeed(device_type)

    # --- devices and process groups (DeepSpeed joins the default group created here) ----------
    dev.import_device_backend(device_type)
    dev.apply_device_env(device_type, cfg.job.deterministic)
    rank, local_rank, world_size = init_distributed(device_type)
    deepspeed.init_distributed(dist_backend=dev.dist_backend(device_type))  # joins that group
    device = dev.local_device(device_type, local_rank)
    init_logger(rank)
    dims = parallel_dims_from_config(cfg, world_size)
    dims.build_mesh(device_type)
    dp_mesh = dims.mesh("dp")
    dp_rank, dp_group = dp_mesh.get_local_rank(), dp_mesh.get_group()
    if cfg.job.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.job.seed)
    logger.info(f"world {world_size} on {device_type}: DeepSpeed ZeRO-{cfg.deepspeed.zero_stage}")

    # --- tokenizer, Engram hashing, model on meta -------------------------------------------
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    hasher = build_hasher(cfg, tokenizer)
    model = build_model_from_config(cfg, tokenizer.vocab_size)
    if hasher is not None:
        logger.info(f"Engram hashing: {hasher}")
        warn_if_tables_collide(hasher)

    # --- tables row-sharded as in train.py; AC; training mode ----------------------------------
    dims.check_model(model.args, cfg.training.seq_len, engram_halo(cfg))
    shard_engram_tables(model, cfg, dims)
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    apply_training_mode(model, cfg.training.mode)
    ds_config = build_ds_config(cfg, world_size)
    # The tables leave the module tree (ZeRO-3 would partition them); the rest becomes the engine.
    if cfg.deepspeed.zero_stage == 3:  # each block (+ its HF tensors) into its partitions
        hf = cfg.model.hf_checkpoint
        plan = plan_hf_load(model, hf, model.args) if hf else None  # checked before any read
        tables = detach_tables(model)
        materialize_into_partitions(model, tables, device, cfg.job.seed, ds_config, plan)
    else:  # ZeRO-1/2 keep whole weights on every rank anyway
        model.to_empty(device=device)
        model.init_weights(seed=cfg.job.seed)
        if cfg.model.hf_checkpoint:  # a resumed run overwrites them with the checkpoint
            load_hf_backbone(model, cfg.model.hf_checkpoint, model.args)
        tables = detach_tables(model)

    # --- optimizers (a torch AdamW for the engine, the tables' own), engine, data -------------
    table_params = list(tables.parameters())
    (dense_optimizer,) = build_optimizers(model, cfg)
    table_optimizers = build_optimizers(tables, cfg) if table_params else []
    schedulers = build_lr_schedulers([dense_optimizer, *table_optimizers], cfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=dense_optimizer, config=ds_config)
    train_loader = build_dataloader(cfg, tokenizer, hasher, dp_rank, dims.dp_size, split="train")

    def make_eval_loader():
        return build_dataloader(cfg, tokenizer, hasher, dp_rank, dims.dp_size, split="val")

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
    fingerprint = config_fingerprint(cfg, tokenizer, hasher)
    fingerprint["engine"] = f"deepspeed-zero{cfg.deepspeed.zero_stage}"
    checkpointer = CheckpointManager(
        cfg.checkpoint,
        cfg.run_folder,
        states=states,
        fingerprint=fingerprint,
        data_meta={
            "global_batch_samples": cfg.training.local_batch_size
            * cfg.training.grad_accum_steps
            * dims.dp_size,
            "seq_len": cfg.training.seq_len,
        },
        folder_states={"engine": EngineCheckpoint(engine)},
    )
    start_step = checkpointer.load()
    metrics = MetricsLogger(cfg.run_folder, cfg.metrics, rank, config_dict=cfg.to_dict())
    guard = NonFiniteGuard(cfg.training.max_nonfinite_steps, checkpointer.last_good_checkpoint)
    result = DeepSpeedResult(
        start_step=start_step, model=model, model_parts=[model], engine=engine, tables=tables
    )

    # --- the loop (host reads on log steps only, plus the guard's one check: as train.py) ------
    gas = cfg.training.grad_accum_steps
    tokens_per_step = cfg.training.local_batch_size * cfg.training.seq_len * gas
    data_iter = iter(train_loader)
    step_losses: list[torch.Tensor] = []
    step_grad_norms: list[torch.Tensor] = []
    dev.reset_peak_memory(device)
    window_start, window_steps = time.perf_counter(), 0
    with maybe_profile(
        cfg.profiling, cfg.run_folder, rank, device_type=device_type, start_step=start_step
    ) as profiler:
        for step in range(start_step + 1, cfg.training.steps + 1):
            last_step = step == cfg.training.steps
            log_step = step % cfg.metrics.log_freq == 0 or last_step
            loss_sum = torch.zeros((), device=device)
            for micro in range(gas):
                batch = to_device(next(data_iter), device)
                logits = engine(batch["input_ids"], hash_ids=batch.get("hash_ids"))
                loss = cross_entropy(logits, batch["labels"])
                engine.backward(loss)  # loss / gas; gradients reduced at the last micro-batch
                loss_sum += loss.detach()
                if micro < gas - 1:
                    engine.step()  # between boundaries DeepSpeed only counts the micro-batch
            grad_norm = clip_engine_and_tables_(engine, table_params, cfg.training.max_norm)
            loss = dp_mean(loss_sum / gas, dp_group)
            grad_norm = grad_norm.detach().float().to(loss.device)
            skip = guard.skip(step, torch.stack([loss, grad_norm]))  # before any update
            applied_lr = scheduled_lr(schedulers[0], cfg.optimizer.lr)
            # A skipped step skips the engine too, also when only the tables' gradients are
            # not finite (DeepSpeed would see finite gradients and apply its update).
            with engine_update_discarded(engine) if skip else nullcontext():
                engine.step()
            for opt in table_optimizers:
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
                        "step_time_s": dt,
                        "tokens_seen": state.tokens_seen,
                        "nonfinite_steps": guard.total,
                        **{f"mem_{k}": v for k, v in mem.items()},
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
                    [engine],
                    make_eval_loader(),
                    cfg.data.eval_batches,
                    device,
                    dp_group,
                    LanguageModelLoss(1, None, sharded_logits=False),
                )
                result.eval_losses[step] = eval_loss
                metrics.log(step, {"eval_loss": eval_loss})
            checkpointer.maybe_save(step, last_step=last_step, finite=not skip)
            if log_step:
                window_start, window_steps = time.perf_counter(), 0
    result.losses = torch.stack(step_losses).tolist() if step_losses else []
    result.grad_norms = torch.stack(step_grad_norms).tolist() if step_grad_norms else []
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
