"""Exact measurement: recipes/train.py's model section on meta under the current (fake) process
group, parallelised by the recipe's own `parallelisms.parallelize.parallelize_model`; parameter,
gradient and optimizer-state bytes are then read from the local shapes of the sharded DTensors."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from engram.config import ConfigError, JobConfig
from engram.config.table_optimizers import table_memory_bytes
from engram.data.tokenizer import load_tokenizer
from engram.models.builder import build_model, flavor_args
from engram.rowstore.memory import STAGING_CHUNK_BYTES
from parallelisms.fsdp import defer_grad_sync
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_model
from parallelisms.pipeline import StagePlan, split_stages
from planner.results import ADAM_STATES, RankMemory, dtype_bytes


def tokenizer_vocab_size(cfg: JobConfig) -> int:
    """The tokenizer's size as recipes/train.py passes it to build_model; the flavor's (or
    model.vocab_size) when the tokenizer file is not on this machine."""
    path = cfg.model.tokenizer_path
    if not path or Path(path).exists():
        return load_tokenizer(path).vocab_size
    flavor_vocab = cfg.model.vocab_size or flavor_args(cfg.model).vocab_size  # flavor "hf" too
    if not flavor_vocab:
        raise ConfigError(
            f"tokenizer {path} does not exist and {cfg.model.name}/{cfg.model.flavor} has no fixed "
            "vocabulary: set model.vocab_size=<rows> (or model.tokenizer_path to a tokenizer.json)"
        )
    return flavor_vocab


def build_rank_parts(
    cfg: JobConfig, dims: ParallelDims, vocab_size: int, table_rows: dict[int, int]
) -> tuple[StagePlan | None, list[int], list[nn.Module], list[nn.Parameter]]:
    """recipes/train.py's model section, on meta, for the rank of the current (fake) process
    group: build, split into this rank's pipeline stages (pp > 1), parallelize_model per part
    (converters, training mode). Returns (plan or None, stage ids, parts, row-sharded tables)."""
    model = build_model(
        cfg.model, cfg.engram, vocab_size, table_rows, "meta", max_seq_len=cfg.training.seq_len
    )
    plan, stage_ids, parts = None, [0], [model]
    if dims.pp_enabled:
        plan, stage_ids, parts = split_stages(model, cfg, dims)
    table_params = []
    for part in parts:
        table_params += parallelize_model(part, cfg, dims)  # sets requires_grad by the mode
    return plan, stage_ids, parts, table_params


def recipe_defers_grad_sync(cfg: JobConfig, dims: ParallelDims) -> bool:
    """Whether recipes/train.py skips the gradient reduction on non-last micro-batches (then
    those keep unsharded gradients): only under DDP, see parallelisms.fsdp.defer_grad_sync."""
    return cfg.training.grad_accum_steps > 1 and defer_grad_sync(dims)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_in(p: nn.Parameter, params: list[nn.Parameter]) -> bool:
    return any(p is q for q in params)


def table_layers(
    parts: list[nn.Module], table_params: list[nn.Parameter]
) -> list[tuple[int, nn.Parameter]]:
    """(Engram layer id, table parameter) in module order, over this rank's model parts."""
    return [
        (layer, p)
        for part in parts
        for layer, block in part.engram_blocks().items()
        for p in table_params
        if p is block.table.weight
    ]


def measure_rank(
    parts: list[nn.Module],
    table_params: list[nn.Parameter],
    rank: int,
    cpu_offload: bool,
    table_optimizer: str = "adam",
    async_checkpoint: bool = False,
    table_location: str = "device",
) -> RankMemory:
    """Exact bytes from the local shapes of this rank's parameters (all its pipeline stages)."""
    params = [p for part in parts for p in part.parameters()]
    dense = [p for p in params if not is_in(p, table_params)]
    dense_trainable = [p for p in dense if p.requires_grad]
    tables_trainable = [p for p in table_params if p.requires_grad]
    dense_bytes = sum(_nbytes(local_tensor(p)) for p in dense)
    dense_grad = sum(_nbytes(local_tensor(p)) for p in dense_trainable)
    table_mem = [  # per optimizer.table_optimizer (engram/optim/lazy_adam.py)
        table_memory_bytes(table_optimizer, *local_tensor(p).shape, local_tensor(p).element_size())
        for p in tables_trainable
    ]
    table_grad = sum(m["grad"] for m in table_mem)
    fp32 = dtype_bytes("float32")
    dense_opt = ADAM_STATES * fp32 * sum(local_tensor(p).numel() for p in dense_trainable)
    table_opt = sum(m["optimizer"] for m in table_mem)
    host = dense_bytes + dense_grad + dense_opt if cpu_offload else 0
    on_device = 0 if cpu_offload else 1
    mem = RankMemory(
        rank=rank,
        dense_params=sum(local_tensor(p).numel() for p in dense),
        dense_param_bytes=dense_bytes,
        table_rows={
            layer: local_tensor(p).shape[0] for layer, p in table_layers(parts, table_params)
        },
        table_params=sum(local_tensor(p).numel() for p in table_params),
        table_param_bytes=sum(_nbytes(local_tensor(p)) for p in table_params),
        grad_bytes=dense_grad + table_grad,
        optimizer_bytes=dense_opt + table_opt,
        buffer_bytes=sum(_nbytes(b) for part in parts for b in part.buffers()),
        optimizer_step_temp_bytes=max(dense_grad * on_device, table_grad),
        host_bytes=host,
    )
    if table_location != "device":  # shards + row-sparse state off the device, plus staging
        # (nvme: planner/nvme.py replaces this with the host cache; the rows live on the drives)
        mem.host_table_bytes = (
            mem.table_param_bytes + table_opt + STAGING_CHUNK_BYTES * len(tables_trainable)
        )
    mem.persistent_bytes = (
        mem.dense_param_bytes + mem.table_param_bytes + mem.grad_bytes + mem.optimizer_bytes
        + mem.buffer_bytes - host - (mem.host_table_bytes and mem.table_param_bytes + table_opt)
    )  # fmt: skip
    if async_checkpoint:  # what a checkpoint holds: weights and optimizer state, not gradients
        mem.async_staging_bytes = (
            mem.dense_param_bytes + mem.table_param_bytes + mem.optimizer_bytes
        )
    return mem
