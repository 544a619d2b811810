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
step is train.py's (runner/step.py) with the engine's parts (runner/engine_step.py):
`engine.backward` per micro-batch, then one global gradient norm over engine + tables
(DeepSpeed's own clipping is off), the non-finite guard, `engine.step()` and the tables' step.
The loop at the end is train.py's, written out here too (edit it as there; runner/loop.py
`TrainRun`). The step folder holds the engine's checkpoint and the tables' DCP shards,
committed together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from engram.checkpoint import ModelState, OptimizerState, TrainState
from engram.config import JobConfig, load_config
from engram.optim.builder import SchedulersState, build_lr_schedulers, build_optimizers
from engram.runtime import device as dev
from engram.train.build import build_checkpointer, build_loaders, build_meta_model, init_process
from engram.train.flops import model_flops
from engram.train.metrics import logger
from engram.train.progress import TrainResult
from parallelisms.parallel_dims import parallel_dims_from_config
from runner.deepspeed_engine import (
    EngineCheckpoint,
    build_ds_config,
    check_layout,
    import_deepspeed,
    place_for_engine,
)
from runner.engine_step import EngineStep
from runner.loop import TrainRun, run_recipe


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
    cfg = cfg.at_dp(dims.dp_size)  # training.global_batch_size -> grad_accum_steps
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
        folder_states={"engine": EngineCheckpoint(engine, cfg.comm.train_timeout_s)},
    )  # fmt: skip
    start_step = checkpointer.load()
    run = TrainRun(cfg, proc, checkpointer, state, flops, start_step)  # metrics, the guard

    # --- the loop, as in train.py; the step is train.py's with the engine's parts
    # (runner/engine_step.py)
    engine_step = EngineStep(
        cfg, dims, engine, table_params, table_optimizers, schedulers, run.guard, dp_group
    )
    with run.start(engine_step, train_loader, make_eval_loader):
        for step in range(start_step + 1, cfg.training.steps + 1):
            batches, ahead = run.batches(step)
            out = engine_step(batches, step, ahead)
            run.end_step(step, out)
    result = DeepSpeedResult(
        start_step=start_step, model=model, model_parts=[model], engine=engine, tables=tables
    )
    return run.finish(result)


def main(argv: list[str] | None = None) -> None:
    run_recipe(train, load_config(argv))


if __name__ == "__main__":
    main()
