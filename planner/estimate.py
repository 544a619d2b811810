"""The estimate of one config at one world size, in steps: check the request (and that the
planner models every step and setting, planner/registry.py), build and measure each requested
rank under a fake process group (one more per pipeline coordinate for the all-ranks summary),
then settle each rank's peak and the replicated-table baseline."""

from __future__ import annotations

import dataclasses
import logging

import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from engram.config import ConfigError, JobConfig
from engram.hashing.ngram import engram_table_rows
from engram.models.builder import build_model
from engram.runtime.device_specs import DEVICE_SPECS
from parallelisms.float8 import check_float8_device
from parallelisms.parallel_dims import ParallelDims, parallel_dims_from_config
from parallelisms.pipeline import check_schedule
from planner.activations import cp_mask_bytes, float8_cast_bytes, rank_activations
from planner.comm import comm_per_step
from planner.fsdp_buffers import fsdp_buffers
from planner.measure import (
    build_rank_parts,
    measure_rank,
    recipe_defers_grad_sync,
    tokenizer_vocab_size,
)
from planner.nvme import nvme_tier
from planner.placement import all_ranks_summary, stage_ranks_summary
from planner.registry import check_modelled
from planner.results import (
    GIB,
    ActivationEstimate,
    AllRanks,
    FsdpBuffers,
    MemoryEstimate,
    RankActivations,
    RankMemory,
)
from planner.table_checkpoint import table_checkpoint, table_checkpoint_problems
from planner.tables import replicated_tables
from planner.tier_results import TierAssumptions

# The default budget per device type: the usable memory the device reports to PyTorch (about
# 60.96 GiB of a "64 GB" Atlas A2), not the nameplate; engram/runtime/device_specs.py has the
# figures and their sources. Other device types (cpu) are budgeted as a 64 GB NPU.
DEVICE_MEMORY_GIB = {name: spec.usable_memory_gib for name, spec in DEVICE_SPECS.items()}


# Device memory the allocator counts as active besides the model's tensors: the BLAS / operator
# workspaces of the compute stream (cuBLAS and cuBLASLt take theirs from PyTorch's caching
# allocator, CANN operators likewise) and the step's small tensors (batch, ids, scalars). The
# allowance is fitted: the two H200 rows of docs/memory_estimate.md whose peak it decides ran
# 0.066 and 0.068 GiB above the modelled tensors; 0.25 covers that with margin
# (tests/test_planner_calibration.py checks it held out). cpu has none.
RUNTIME_WORKSPACE_GIB = 0.25


def default_ranks(world_size: int) -> list[int]:
    return sorted({0, min(1, world_size - 1), world_size // 2, world_size - 1})


def _phases(
    f: FsdpBuffers,
    act: RankActivations,
    opt_temp: int,
    float8_bytes: int = 0,
    grads_not_yet: int = 0,
    workspace: int = 0,
) -> dict[str, int]:
    """Transient bytes at the moments that can set the peak (each a sum of coexisting items).
    `grads_not_yet`: persistent gradient bytes that do not exist yet at the loss (RankMemory
    .grads_freed_at_loss), taken off that phase; `workspace` (RUNTIME_WORKSPACE_GIB) is in all.
    The model's output, held until backward ends, is in the loss's bytes and in both backward
    phases."""
    acc = f.no_sync_accum_bytes + workspace
    return {
        "forward end (loss)": (
            f.root_gather_bytes + act.saved_bytes + act.loss_bytes + acc - grads_not_yet
        ),
        "decoder-layer backward": (
            f.root_gather_bytes
            + f.root_grad_bytes
            + f.layer_gather_bytes
            + act.saved_bytes
            + act.recompute_bytes
            + act.held_output_bytes
            + f.layer_reduce_bytes
            + float8_bytes
            + acc
        ),  # fmt: skip
        "backward end (root reduce)": (
            f.root_gather_bytes
            + f.root_grad_bytes
            + f.root_reduce_bytes
            + act.held_output_bytes
            + acc
        ),
        "optimizer step": opt_temp + workspace,
    }


def _checked_ranks(world_size: int, ranks: list[int] | None) -> list[int]:
    """The ranks to report (default_ranks when None), each inside 0..world_size-1."""
    if dist.is_initialized():
        raise RuntimeError(
            "estimate() plays every rank under its own fake process group: call it in a process "
            "without an initialised process group"
        )
    if world_size < 1:
        raise ConfigError(f"--world_size must be >= 1, got {world_size}")
    ranks = default_ranks(world_size) if ranks is None else sorted(set(ranks))
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"ranks {bad} are outside 0..{world_size - 1} (--ranks)")
    return ranks


def _planning_config(cfg: JobConfig) -> JobConfig:
    """The config as the fake CPU mesh can build it: float8 emulated (same per-rank bytes:
    Float8Linear keeps high-precision weights); npu float8 refused exactly as in training."""
    if not cfg.float8.enable:
        return cfg
    # The recipe's "float8 without compile is slow" warning would repeat once per rank here.
    logging.getLogger("parallelisms.float8").setLevel(logging.ERROR)
    if cfg.job.device == "npu":
        check_float8_device(cfg.float8, "npu")
    return dataclasses.replace(cfg, float8=dataclasses.replace(cfg.float8, emulate=True))


def _measure_rank(
    cfg: JobConfig,
    dims: ParallelDims,
    rank: int,
    parts_of_rank: tuple,
    whole: nn.Module,
    n_micro: int,
    no_sync: bool,
) -> tuple[RankMemory, list[ActivationEstimate]]:
    """Every number of one built rank but its peak: exact bytes, FSDP buffers, activations,
    float8 casts and communication."""
    plan, stage_ids, parts, table_params = parts_of_rank
    mem = measure_rank(
        parts,
        table_params,
        rank,
        cfg.parallelism.cpu_offload,
        cfg.optimizer.table_optimizer,
        async_checkpoint=cfg.checkpoint.enable and cfg.checkpoint.async_mode == "async",
        table_location=cfg.engram.table_location if cfg.engram.enabled else "device",
    )
    mem.stages = stage_ids
    mem.stage_layers = (
        {s: plan.layers[s] for s in stage_ids} if plan else {0: list(range(whole.args.n_layers))}
    )
    mem.fsdp = fsdp_buffers(cfg, dims, parts, table_params, no_sync)
    mem.grads_freed_at_loss = n_micro == 1 and cfg.training.grad_accum_steps == 1
    mem.workspace_bytes = 0 if cfg.job.device == "cpu" else int(RUNTIME_WORKSPACE_GIB * GIB)
    mem.activations, acts = rank_activations(
        cfg,
        whole.args,
        mem.fsdp.compute_dtype,
        dims.tp,
        cfg.parallelism.tp_sequence_parallel,
        plan,
        stage_ids,
        dims.mesh("pp").get_local_rank(),
        n_micro,
        dims.cp,
        dims.cp_method,
    )
    if cfg.float8.enable:  # each cp rank's linears see its tokens / cp
        local_tokens = mem.activations.microbatch_tokens // dims.cp
        mem.float8_cast_bytes, mem.float8_largest_linear = max(
            float8_cast_bytes(part, local_tokens, dims.tp) for part in parts
        )
    n_layers = sum(len(layers) for layers in mem.stage_layers.values())
    mem.cp_mask_bytes = cp_mask_bytes(cfg, dims.cp, dims.cp_method, n_layers)
    mem.persistent_bytes += mem.cp_mask_bytes
    mem.comm = comm_per_step(cfg, dims, parts, table_params, mem, plan)
    if mem.host_table_bytes:
        _host_table_traffic(mem, cfg, dims.divisors.engram_tokens, n_micro)
    return mem, acts


def _host_table_traffic(mem: RankMemory, cfg: JobConfig, split: int, n_micro: int) -> None:
    """Device bytes of one micro-batch's looked-up rows and host <-> device bytes per step of
    host tables (parallelisms/engram_tables/host.py), at most one row per lookup id: each rank
    looks up its own tokens' ids, 1 / `split` of the micro-batch (cp x tp, axis_divisors'
    engram_tokens; hash heads per Engram layer on this rank)."""
    ids = mem.activations.microbatch_tokens // split * cfg.engram.num_heads * len(mem.table_rows)
    row_bytes = cfg.engram.head_dim * mem.table_param_bytes // max(1, mem.table_params)
    mem.host_table_device_bytes = 2 * ids * row_bytes
    per_micro = ids * row_bytes + ids * (cfg.engram.head_dim * 4 + 8)  # rows in, grads + ids out
    mem.host_link_bytes = per_micro * n_micro * cfg.training.grad_accum_steps
    mem.persistent_bytes += mem.host_table_device_bytes


def _settle_peak(mem: RankMemory, fragmentation: float, reserve: int, device_bytes: int) -> None:
    """The rank's peak: persistent + the largest phase, plus fragmentation and the reserve."""
    mem.phases = _phases(
        mem.fsdp,
        mem.activations,
        mem.optimizer_step_temp_bytes,
        mem.float8_cast_bytes,
        mem.grad_bytes if mem.grads_freed_at_loss else 0,
        mem.workspace_bytes,
    )
    mem.peak_phase = max(mem.phases, key=mem.phases.__getitem__)
    mem.transient_bytes = mem.phases[mem.peak_phase]
    mem.fragmentation_bytes = int(fragmentation * (mem.persistent_bytes + mem.transient_bytes))
    mem.reserve_bytes = reserve
    mem.peak_bytes = mem.persistent_bytes + mem.transient_bytes + mem.fragmentation_bytes + reserve
    mem.headroom_bytes = device_bytes - mem.peak_bytes


def _micro_batches(
    cfg: JobConfig, dims: ParallelDims, sync_every_micro_batch: bool
) -> tuple[int, bool]:
    """(micro-batches per schedule step, whether unsharded gradients are kept across
    micro-batches): the recipe's no-sync DDP accumulation, or a pipeline stage (torch's stage
    turns gradient sync off for all but the last micro-batch)."""
    n_micro = (
        check_schedule(cfg.pipeline, dims.pp, cfg.training.local_batch_size)
        if dims.pp_enabled
        else 1
    )
    pp_micro = n_micro > 1
    no_sync = (recipe_defers_grad_sync(cfg, dims) and not sync_every_micro_batch) or pp_micro
    return n_micro, no_sync


def _measure_ranks(
    cfg: JobConfig,
    world_size: int,
    ranks: list[int],
    pp: int,
    vocab_size: int,
    table_rows: dict[int, int],
    whole: nn.Module,
    n_micro: int,
    no_sync: bool,
) -> tuple[list[RankMemory], AllRanks, list[ActivationEstimate]]:
    """Build each requested rank under its own fake process group and measure it, plus one
    built rank per pipeline coordinate, which gives every rank's numbers (all_ranks_summary)."""
    per_stage = world_size // pp
    representatives = {c * per_stage for c in range(pp)}
    results: list[RankMemory] = []
    summaries, stage_acts = [], []
    for rank in sorted(set(ranks) | representatives):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            dims = parallel_dims_from_config(cfg, world_size)
            dims.build_mesh("cpu")
            parts_of_rank = build_rank_parts(cfg, dims, vocab_size, table_rows)
            _, _, parts, table_params = parts_of_rank
            if rank in representatives:
                summaries.append(stage_ranks_summary(parts, table_params, dims))
            if rank in ranks:
                mem, acts = _measure_rank(cfg, dims, rank, parts_of_rank, whole, n_micro, no_sync)
                stage_acts = stage_acts or acts
                results.append(mem)
        finally:
            dist.destroy_process_group()
    return results, all_ranks_summary(summaries, dims), stage_acts


def estimate(
    cfg: JobConfig,
    world_size: int,
    ranks: list[int] | None = None,
    device_memory_gib: float | None = None,
    fragmentation: float = 0.10,
    reserve_gib: float = 3.0,
    sync_every_micro_batch: bool = False,
    ranks_per_node: int = 8,
    host_memory_gib: float | None = None,
    host_link_gbs: float = 25.0,
    tier: TierAssumptions | None = None,
) -> MemoryEstimate:
    """Build the config's model for each rank in `ranks` under a fake process group of
    `world_size` and return exact per-rank bytes plus the labelled estimates.

    `sync_every_micro_batch` models a recipe that reduce-scatters after every micro-batch
    instead of recipes/train.py's no-sync gradient accumulation. Host tables
    (engram.table_location = host): `ranks_per_node` ranks share a node's `host_memory_gib`
    (default: engram.host_memory_gib; 0 / unset: not checked) and copy rows over a host link of
    `host_link_gbs` GB/s per device (an assumption, printed). NVMe tables and table checkpoints
    are planned with the hardware and reuse figures of `tier` (default TierAssumptions())."""
    ranks = _checked_ranks(world_size, ranks)
    check_modelled(cfg)
    if device_memory_gib is None:
        device_memory_gib = DEVICE_MEMORY_GIB.get(cfg.job.device, DEVICE_MEMORY_GIB["npu"])
    cfg = _planning_config(cfg)
    dims = parallel_dims_from_config(cfg, world_size)  # validates the degrees up front
    cfg = cfg.at_dp(dims.dp_size)  # training.global_batch_size -> grad_accum_steps, as the recipe
    n_micro, no_sync = _micro_batches(cfg, dims, sync_every_micro_batch)
    table_rows = engram_table_rows(cfg.engram)
    vocab_size = tokenizer_vocab_size(cfg)
    whole = build_model(
        cfg.model, cfg.engram, vocab_size, table_rows, "meta", max_seq_len=cfg.training.seq_len
    )
    results, all_ranks, stage_acts = _measure_ranks(
        cfg, world_size, ranks, dims.pp, vocab_size, table_rows, whole, n_micro, no_sync
    )
    device_bytes = int(device_memory_gib * GIB)
    reserve = int(reserve_gib * GIB)
    for mem in results:
        _settle_peak(mem, fragmentation, reserve, device_bytes)
    n_global = sum(p.numel() for p in whole.parameters())
    n_tables = sum(b.table.weight.numel() for b in whole.engram_blocks().values())
    est = MemoryEstimate(
        config_file=cfg.job.config_file,
        model=f"{cfg.model.name}/{cfg.model.flavor}",
        world_size=world_size,
        parallel_dims=repr(dims),
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        grad_accum_steps=cfg.training.grad_accum_steps,
        activation_checkpoint=cfg.activation_checkpoint.mode,
        training_mode=cfg.training.mode,
        global_params=n_global,
        global_dense_params=n_global - n_tables,
        model_dim=whole.args.dim,
        n_layers=whole.args.n_layers,
        vocab_size=whole.args.vocab_size,
        tied_embeddings=whole.args.tie_embeddings,
        global_table_params=n_tables,
        table_rows_global=dict(table_rows),
        device_memory_bytes=device_bytes,
        recipe_defers_grad_sync=recipe_defers_grad_sync(cfg, dims),
        no_sync_accumulation=no_sync,
        fragmentation=fragmentation,
        reserve_bytes=reserve,
        stage_activations=stage_acts,
        float8=cfg.float8.recipe if cfg.float8.enable else "off",
        ranks=results,
        all_ranks=all_ranks,
        replicated_tables=replicated_tables(
            results, table_rows, n_tables, world_size // dims.pp, fragmentation
        ),
        **_layout_fields(cfg, dims, n_micro),
        **_host_table_fields(cfg, world_size, ranks_per_node, host_memory_gib, host_link_gbs),
    )
    _plan_table_tiers(est, cfg, tier or TierAssumptions())
    return est


def _layout_fields(cfg: JobConfig, dims: ParallelDims, n_micro: int) -> dict:
    """MemoryEstimate's TP, PP and CP description."""
    return dict(
        tp=dims.tp,
        sequence_parallel=cfg.parallelism.tp_sequence_parallel,
        pp=dims.pp,
        pipeline=(
            f"{cfg.pipeline.schedule}, {n_micro} micro-batches, "
            f"{cfg.pipeline.virtual_stages} stage(s) per rank"
            if dims.pp_enabled
            else "off"
        ),
        cp=dims.cp,
        cp_method=dims.cp_method,
    )


def _host_table_fields(
    cfg: JobConfig,
    world_size: int,
    ranks_per_node: int,
    host_memory_gib: float | None,
    host_link_gbs: float,
) -> dict:
    """MemoryEstimate's host-table settings: where the tables live, the node's host memory and
    the host link."""
    return dict(
        table_location=cfg.engram.table_location if cfg.engram.enabled else "device",
        ranks_per_node=min(ranks_per_node, world_size),
        host_memory_bytes=int(
            (cfg.engram.host_memory_gib if host_memory_gib is None else host_memory_gib) * GIB
        ),
        host_link_gbs=host_link_gbs,
    )


def _plan_table_tiers(est: MemoryEstimate, cfg: JobConfig, tier: TierAssumptions) -> None:
    """NVMe tier and table checkpoint terms of the largest reported rank, per node."""
    if est.table_location == "device":
        return
    worst = max(est.ranks, key=lambda m: sum(m.table_rows.values()))
    args = (cfg, worst, est.ranks_per_node, est.host_memory_bytes, tier)
    if est.table_location == "nvme":
        est.nvme = nvme_tier(*args)
        for m in est.ranks:  # the host holds the cache, not the shard
            m.host_table_bytes = est.nvme.host_bytes_needed // est.ranks_per_node
    est.table_checkpoint = table_checkpoint(*args)
    if est.nvme is not None:
        est.nvme.problems += table_checkpoint_problems(
            est.table_checkpoint, est.nvme.host_bytes_needed
        )
