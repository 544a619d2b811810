"""Train a dense LLM with Engram memory. Copy this file and edit it; it reads top to bottom.

    CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh [--section.key=value ...]
    TRAIN_SCRIPT=my_train.py CONFIG_FILE=... ./run_train.sh      # your copy

The model is built on meta, then placed on this rank by runner/model_parts.py: the
parallelisms in the order stated in parallelisms/parallelize.py, then materialised and
initialised (init is independent of the layout). It is held as `model_parts` (one part; under
pipeline parallelism this rank's stages, each split from the meta model first and then
parallelised). The loop is at the end, written out: per optimizer step the data
(`run.batches`), runner/step.py's TrainStep (the context-parallel cut, host-table prefetch,
forward / backward per micro-batch or the PP schedule, clip, the non-finite guard, the update:
the one step that check_cluster's real_step and bench_mfu time too), then `run.end_step`
(record; evaluate: the held-out loss and, with data.eval_exact_match, greedy answers to held-out
questions; save). Add a metric, another evaluation cadence, an early stop or a hook after the
update there; what each `run.` call does is runner/loop.py's `TrainRun`. With export.folder set,
the last checkpoint is exported when training ends (run_recipe). The other pieces are
engram/train/ (build.py, progress.py, ...) and runner/model_parts.py.
"""

from __future__ import annotations

from engram.checkpoint import ModelState, OptimizerState, TrainState
from engram.config import JobConfig, load_config
from engram.hf.load import load_frozen_backbone, load_hf_at_start
from engram.optim.builder import (
    SchedulersState,
    build_lr_schedulers,
    build_optimizers,
    saved_params,
)
from engram.runtime import device as dev
from engram.train.build import (
    build_checkpointer,
    build_loaders,
    build_meta_model,
    init_process,
)
from engram.train.flops import model_flops
from engram.train.metrics import logger
from engram.train.progress import TrainResult
from parallelisms.parallel_dims import parallel_dims_from_config
from runner.exact_match import build_exact_match
from runner.loop import TrainRun, run_recipe
from runner.model_parts import build_model_parts
from runner.step import TrainStep


def train(cfg: JobConfig) -> TrainResult:
    # --- devices and process groups -------------------------------------------------------
    proc = init_process(cfg)
    device = proc.device
    dims = parallel_dims_from_config(cfg, proc.world_size)
    cfg = cfg.at_dp(dims.dp_size)  # training.global_batch_size -> grad_accum_steps
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
    exact_match = build_exact_match(cfg, tokenizer, hasher)  # data.eval_exact_match, or None

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
    # The run's record (runner/loop.py): metrics.jsonl, TensorBoard, the non-finite guard.
    run = TrainRun(cfg, proc, checkpointer, state, flops, start_step)
    load_hf_at_start(model_parts, cfg, start_step, frozen_read=hf_first)

    # --- the loop: edit it here (a metric, another evaluation cadence, an early stop, a hook
    # after the update). Per step: this step's micro-batches and the next step's (read ahead);
    # the one step (runner/step.py: the CP cut, host-table prefetch, forward / backward per
    # micro-batch or the PP schedule, clip, the non-finite guard, the update); then
    # run.end_step: record, evaluate, save (runner/loop.py)
    train_step = TrainStep(
        cfg, dims, model_parts, loss_fn, optimizers, schedulers, pp=pp, guard=run.guard,
        dp_group=dp_group,
    )  # fmt: skip
    with run.start(train_step, train_loader, make_eval_loader, exact_match):
        for step in range(start_step + 1, cfg.training.steps + 1):
            batches, ahead = run.batches(step)
            out = train_step(batches, step, ahead)
            run.end_step(step, out)
    return run.finish(TrainResult(start_step=start_step, model=model, model_parts=model_parts))


def main(argv: list[str] | None = None) -> None:
    run_recipe(train, load_config(argv))


if __name__ == "__main__":
    main()
