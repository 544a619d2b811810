"""Train a dense LLM with Engram memory. Copy this file and edit it; it reads top to bottom.

    CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh [--section.key=value ...]

Order of application (torchtitan's): build on meta -> Engram table row-sharding -> activation
checkpointing -> FSDP2 / HSDP / DDP -> materialise + initialise (init independent of the layout).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engram import device as dev
from engram.checkpoint import CheckpointManager, ModelState, OptimizerState, TrainState
from engram.config import JobConfig, load_config
from engram.data.loader import build_dataloader
from engram.data.tokenizer import load_tokenizer
from engram.distributed import destroy_distributed, init_distributed
from engram.fingerprint import config_fingerprint
from engram.hf_load import load_hf_backbone
from engram.metrics import MetricsLogger, init_logger, logger
from engram.models.builder import build_from_config
from engram.nonfinite import NonFiniteGuard
from engram.optim import apply_training_mode, build_lr_schedulers, build_optimizers, clip_grad_norm_
from engram.profiling import maybe_profile
from engram.table_check import warn_if_tables_collide
from parallelisms.fsdp import defer_grad_sync
from parallelisms.parallel_dims import parallel_dims_from_config
from parallelisms.parallelize import parallelize_model


@dataclass
class TrainResult:
    """What a run leaves behind in memory (tests and notebooks use it; files are the real record)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    model: torch.nn.Module | None = None
    start_step: int = 0


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def dp_mean(value: torch.Tensor, group: dist.ProcessGroup) -> float:
    """Mean of a per-rank scalar over the data-parallel ranks (for logging only)."""
    value = value.detach().float().clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


@torch.no_grad()
def evaluate(model, loader, num_batches: int, device, dp_group) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    it = iter(loader)
    for _ in range(num_batches):
        batch = to_device(next(it), device)
        total += cross_entropy(model(batch["input_ids"], batch.get("hash_ids")), batch["labels"])
    model.train()
    return dp_mean(total / num_batches, dp_group)


def train(cfg: JobConfig) -> TrainResult:
    # --- devices and process groups -------------------------------------------------------
    device_type = dev.resolve_device_type(cfg.job.device)
    dev.import_device_backend(device_type)
    rank, local_rank, world_size = init_distributed(device_type)
    device = dev.local_device(device_type, local_rank)
    init_logger(rank)
    dims = parallel_dims_from_config(cfg, world_size)
    dims.build_mesh(device_type)
    dp_mesh = dims.mesh("dp")
    dp_rank, dp_group = dp_mesh.get_local_rank(), dp_mesh.get_group()
    if cfg.job.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.job.seed)
    logger.info(f"world {world_size} on {device_type}: {dims}")

    # --- tokenizer, Engram hashing, model on meta -----------------------------------------
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    model, hasher = build_from_config(cfg, tokenizer)
    if hasher is not None:
        logger.info(f"Engram hashing: {hasher}")
        warn_if_tables_collide(hasher)

    # --- parallelisms, in the documented order ---------------------------------------------
    parallelize_model(model, cfg, dims)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.job.seed)
    apply_training_mode(model, cfg.training.mode)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        f"model {cfg.model.name}/{cfg.model.flavor}: {n_params:,} local parameters on this rank"
    )

    optimizers = build_optimizers(model, cfg)
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
            "model": ModelState(model),
            "optimizer": OptimizerState(model, optimizers),
            "lr_scheduler": _SchedulersState(schedulers),
            "dataloader": train_loader,
            "train_state": state,
        },
        fingerprint=config_fingerprint(cfg, tokenizer, hasher),
    )
    start_step = checkpointer.load()
    # Only now: a refused resume must leave the run folder's config record untouched.
    metrics = MetricsLogger(cfg.run_folder, cfg.metrics, rank, config_dict=cfg.to_dict())
    guard = NonFiniteGuard(cfg.training.max_nonfinite_steps, checkpointer.last_good_checkpoint)
    if cfg.model.hf_checkpoint and start_step == 0:  # a resumed run has its weights already
        if cfg.engram.enabled and cfg.engram.init != "identity":
            logger.warning(
                "engram.init is not 'identity': the pretrained function changes at step 0"
            )
        load_hf_backbone(model, cfg.model.hf_checkpoint, model.args)
    result = TrainResult(start_step=start_step, model=model)

    # --- the loop ---------------------------------------------------------------------------
    tokens_per_step = (
        cfg.training.local_batch_size * cfg.training.seq_len * cfg.training.grad_accum_steps
    )
    data_iter = iter(train_loader)
    trainable = [p for p in model.parameters() if p.requires_grad]
    dev.reset_peak_memory(device)
    with maybe_profile(
        cfg.profiling, cfg.run_folder, rank, device_type=device_type, start_step=start_step
    ) as profiler:
        for step in range(start_step + 1, cfg.training.steps + 1):
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.training.grad_accum_steps):
                batch = to_device(next(data_iter), device)
                last_micro = micro == cfg.training.grad_accum_steps - 1
                # DDP reduces once per optimizer step; FSDP/HSDP every micro-batch (see fsdp.py).
                if defer_grad_sync(dims):
                    model.set_requires_gradient_sync(last_micro)
                loss = cross_entropy(
                    model(batch["input_ids"], batch.get("hash_ids")), batch["labels"]
                )
                (loss / cfg.training.grad_accum_steps).backward()
                loss_sum += loss.detach()
            grad_norm = clip_grad_norm_(trainable, cfg.training.max_norm)
            loss_value = dp_mean(loss_sum / cfg.training.grad_accum_steps, dp_group)
            skip = guard.skip(step, loss_value, grad_norm.item())  # before any update
            for opt in optimizers:
                if not skip:
                    opt.step()
                opt.zero_grad(set_to_none=True)
            for sched in schedulers:
                sched.step()
            profiler.step()
            state.step = step
            state.tokens_seen += tokens_per_step * dims.dp_size
            result.losses.append(loss_value)
            result.grad_norms.append(grad_norm.item())
            dev.synchronize(device)
            dt = time.perf_counter() - t0
            if step % cfg.metrics.log_freq == 0 or step == cfg.training.steps:
                mem = dev.memory_stats(device)
                metrics.log(
                    step,
                    {
                        "loss": loss_value,
                        "lr": schedulers[0].get_last_lr()[0],
                        "grad_norm": grad_norm.item(),
                        "tokens_per_s": tokens_per_step * dims.dp_size / dt,
                        "step_time_s": dt,
                        "tokens_seen": state.tokens_seen,
                        "nonfinite_steps": guard.total,
                        **{f"mem_{k}": v for k, v in mem.items()},
                    },
                )
            if cfg.data.eval_batches > 0 and (
                (cfg.data.eval_every and step % cfg.data.eval_every == 0)
                or step == cfg.training.steps
            ):
                eval_loss = evaluate(
                    model, make_eval_loader(), cfg.data.eval_batches, device, dp_group
                )
                result.eval_losses[step] = eval_loss
                metrics.log(step, {"eval_loss": eval_loss})
            checkpointer.maybe_save(step, last_step=step == cfg.training.steps)
    metrics.close()
    return result


class _SchedulersState:
    """Stateful view over the lr schedulers (one per optimizer)."""

    def __init__(self, schedulers):
        self.schedulers = schedulers

    def state_dict(self):
        return {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}

    def load_state_dict(self, sd):
        for i, s in enumerate(self.schedulers):
            s.load_state_dict(sd[str(i)])


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
