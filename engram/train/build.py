"""What both recipes build before their loop, in their order: the process (device, default
process group, logger, seed), the tokenizer / hasher / model on meta, the data loaders and the
checkpoint manager of the run folder.

How the model is placed on ranks is not here: that is runner/ over parallelisms/ (FSDP2 / TP /
PP: runner/model_parts.py; DeepSpeed: runner/deepspeed_engine.py), which engram/ does not
import; the recipe passes this module the placed model's states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engram.checkpoint import CheckpointManager
from engram.checkpoint.fingerprint import config_fingerprint
from engram.checkpoint.state import ModelState, OptimizerState
from engram.checkpoint.table_delta import TableDeltas
from engram.config import JobConfig
from engram.data.loader import DataLoader, build_dataloader
from engram.data.tokenizer import Tokenizer, load_tokenizer
from engram.hashing.ngram import NgramHasher
from engram.models.builder import build_hasher, build_model_from_config
from engram.runtime import device as dev
from engram.runtime.affinity import pin_to_device_numa
from engram.runtime.distributed import init_distributed
from engram.runtime.logs import init_logging
from engram.train.metrics import logger
from engram.train.table_check import warn_if_tables_collide
from engram.train.throughput import log_device_memory


@dataclass
class Process:
    """This process in the job: its device and its place in the default process group."""

    device_type: str
    device: torch.device
    rank: int
    world_size: int


def init_process(cfg: JobConfig) -> Process:
    """Device backend, the runtime environment, the default process group, the rank's logger,
    CPU affinity, determinism and the seed. Logs (rank 0) each runtime default it applied."""
    device_type = dev.resolve_device_type(cfg.job.device)
    dev.import_device_backend(device_type)
    compile_warning = cfg.compile.check_device(device_type)  # job.device = auto that is npu
    # hccl cannot change a group's timeout after creation (set_pg_timeouts): create it with the
    # longer one there. HCCL_EXEC_TIMEOUT follows the same figure.
    comm = cfg.comm
    longest = max(comm.init_timeout_s, comm.train_timeout_s)
    init_timeout = longest if device_type == "npu" else comm.init_timeout_s
    env = dev.apply_device_env(device_type, cfg.job.deterministic, longest)  # before HCCL / alloc
    rank, local_rank, world_size = init_distributed(device_type, timeout_s=init_timeout)
    device = dev.local_device(device_type, local_rank)
    init_logging(rank)
    log_device_memory(device)  # total / free beside the usable figure, before anything is placed
    affinity = pin_to_device_numa(device, cfg.job.cpu_affinity)
    logger.info(
        f"runtime: process-group timeout {init_timeout} s until the first step, then "
        f"{init_timeout if device_type == 'npu' else comm.train_timeout_s} s ([comm]); {affinity}"
    )
    if env_line := dev.describe_env(device_type, env, longest):
        logger.info(f"runtime environment: {env_line}")
    if compile_warning:
        logger.warning(compile_warning)
    if cfg.job.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.job.seed)
    return Process(device_type, device, rank, world_size)


def build_meta_model(cfg: JobConfig) -> tuple[Tokenizer, NgramHasher | None, nn.Module]:
    """The tokenizer, the Engram hasher (None without Engram) and the model on meta. The hasher
    feeds the data loader; the model needs only the table sizes (from the config)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    hasher = build_hasher(cfg, tokenizer)
    model = build_model_from_config(cfg, tokenizer.vocab_size)
    if hasher is not None:
        logger.info(f"Engram hashing: {hasher}")
        warn_if_tables_collide(hasher)
    if cfg.model.attn_mask_type == "block_causal":
        b, t = cfg.training.local_batch_size, cfg.training.seq_len
        mask = (
            f"a bool [B, T, T] mask, {b * t * t / 2**20:.1f} MiB per local batch, and an "
            "additive copy of it saved per layer"
            if cfg.model.attn_backend == "sdpa"
            else "a block mask (no T x T tensor)"
        )
        logger.info(
            f"attention: block_causal over the packed documents of segment_ids "
            f"({cfg.model.attn_backend}: {mask}); RoPE restarts per document, the Engram "
            "ShortConv stops at document starts"
        )
    return tokenizer, hasher, model


def build_loaders(
    cfg: JobConfig, tokenizer: Tokenizer, hasher: NgramHasher | None, dp_rank: int, dp_size: int
) -> tuple[DataLoader, Callable[[], DataLoader]]:
    """The training loader and a factory of held-out loaders: a fresh one per evaluation scores
    the same batches every time."""
    train_loader = build_dataloader(cfg, tokenizer, hasher, dp_rank, dp_size, split="train")

    def make_eval_loader() -> DataLoader:
        return build_dataloader(cfg, tokenizer, hasher, dp_rank, dp_size, split="val")

    return train_loader, make_eval_loader


def build_checkpointer(
    cfg: JobConfig,
    tokenizer: Tokenizer,
    hasher: NgramHasher | None,
    dp_size: int,
    states: dict[str, Any],
    engine: str | None = None,
    folder_states: dict[str, Any] | None = None,
) -> CheckpointManager:
    """The run folder's checkpoint manager over `states`. `engine` (e.g. "deepspeed-zero3") joins
    the fingerprint: a checkpoint of one engine is not resumed by another; `folder_states` are
    saved as files of the step folder (an engine's own checkpoint)."""
    fingerprint = config_fingerprint(cfg, tokenizer, hasher)
    if engine is not None:
        fingerprint["engine"] = engine
    return CheckpointManager(
        cfg.checkpoint,
        cfg.run_folder,
        states=states,
        fingerprint=fingerprint,
        data_meta={
            "global_batch_samples": cfg.training.local_batch_size
            * cfg.training.grad_accum_steps
            * dp_size,
            "seq_len": cfg.training.seq_len,
        },
        folder_states=folder_states,
        tables=_table_deltas(states),
    )


def _table_deltas(states: dict[str, Any]) -> TableDeltas | None:
    """The row-sparse tables of the model and optimizer states (incremental table saves)."""
    model, optimizer = states.get("model"), states.get("optimizer")
    if not isinstance(model, ModelState) or not isinstance(optimizer, OptimizerState):
        return None
    return TableDeltas(model.parts, [o for _, opts in optimizer.pairs for o in opts])
