"""What a run refuses, or warns about, before step 1: the memory planner's checks of the NVMe
tier and the checkpoints, by the planner's own rules (engram/rowstore/tier_rules.py,
engram/checkpoint/capacity.py), fed with what this rank finds instead of assumed hardware: its
model as placed (meta shards), the drives' free space, the host's memory, a drive probe.

`refuse_at_start` (runner/model_parts.py, after parallelize_model, before the tables are
allocated), each problem by name, all of them in one error:

- NVMe page files against the free space of each engram.nvme_dirs file system (every rank of
  the node stripes its pages over the same directories; page files of dead runs count as
  free: the stores' sweep removes them);
- checkpoint.async_mode = "async": the staging copy of this rank's state and its NVMe tables
  read out whole, next to the host tables and NVMe caches, against engram.host_memory_gib (or
  MemAvailable), per node;
- the checkpoints keep_latest_k holds at its fullest (one more while a save commits, the bases
  of incremental table chains) against the free space of the checkpoint folder (plus what its
  checkpoints already take: a resume replaces them). The folder is taken to be shared by every
  node (DCP reads it from every rank on resume), so the whole model's state counts.

and warns: an NVMe directory on tmpfs or a network file system; drive endurance of the page
write-backs and of the saves at checkpoint.interval (TierAssumptions' step time and rating).

`report_tiers` (after init, when the page files hold the rows): one line per rank for host /
NVMe tables (rank 0 logs every rank's), and a drive probe (engram.nvme_probe_s of random 4 KiB
reads) set against the page reads a step needs by the planner's rule: a warning naming both.

Figures the run cannot measure before its first step (step time, rows a step touches, their
reuse) are TierAssumptions' defaults, the planner's.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from engram.checkpoint.capacity import (
    ROW_ID_BYTES,
    async_save_host_problem,
    checkpoint_space_problem,
    kept_checkpoint_bytes,
    touched_rows,
)
from engram.config import JobConfig
from engram.config.table_optimizers import table_optimizer_spec
from engram.models.engram import is_table_param
from engram.rowstore.drive_probe import probe_random_reads
from engram.rowstore.nvme_store import page_layout
from engram.rowstore.page_files import dead_page_file_bytes
from engram.rowstore.tier_rules import (
    TierAssumptions,
    drive_writes_per_day,
    endurance_warning,
    lookup_ids_per_owner,
    page_file_bytes,
    page_space_problem,
    pages_read_per_step,
    probe_warning,
    record_bytes,
    step_rows,
)
from engram.runtime import filesystems
from engram.train.metrics import logger
from parallelisms.engram_tables import (
    HostShardedEngramTable,
    NvmeShardedEngramTable,
    ShardedEngramTable,
    host_table_bytes,
    host_table_modules,
    mem_available_bytes,
)
from parallelisms.parallel_dims import ParallelDims

__all__ = ["refuse_at_start", "report_tiers"]

GIB = 2**30
PLAN = TierAssumptions()  # what the run cannot measure at start: the planner's defaults


def _ranks_per_node() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _host_tables(model_parts: list[nn.Module]) -> list[HostShardedEngramTable]:
    return [t for part in model_parts for t in host_table_modules(part)]


def _nvme_tables(model_parts: list[nn.Module]) -> list[NvmeShardedEngramTable]:
    return [t for t in _host_tables(model_parts) if isinstance(t, NvmeShardedEngramTable)]


def _record(cfg: JobConfig) -> int:
    spec = table_optimizer_spec(cfg.optimizer.table_optimizer)
    dim = cfg.engram.head_dim
    return record_bytes(dim, spec.fp32_states_per_param, spec.fp32_states_per_row)


def _ids_per_owner(cfg: JobConfig) -> int:
    t, par = cfg.training, cfg.parallelism
    return lookup_ids_per_owner(
        t.local_batch_size, t.seq_len, t.grad_accum_steps, cfg.engram.num_heads, par.tp, par.cp
    )


def _planned_pages_per_step(cfg: JobConfig, tables: list[NvmeShardedEngramTable]) -> int:
    """Page reads one rank's NVMe tables need per step, by the planner's rule."""
    if not tables:
        return 0
    page, _ = page_layout(_record(cfg))
    local = [_local(t.weight).shape[0] for t in tables]
    rows = max(step_rows(PLAN.unique_rows_per_step, _ids_per_owner(cfg), r) for r in local)
    cache = int(cfg.engram.nvme_host_cache_gib * GIB)
    return pages_read_per_step(PLAN, rows, page, cache, len(tables))


# ----------------------------------------------------------------------------- before init


def refuse_at_start(
    model_parts: list[nn.Module], cfg: JobConfig, dims: ParallelDims, device: torch.device
) -> None:
    """Raise one error naming every problem of this run's drives, host memory and checkpoint
    folder (module docstring), before anything is allocated; log the warnings. Collective
    (the checkpoint's bytes are summed over the pipeline stages): every rank calls it."""
    problems = _page_space_problems(model_parts, cfg)
    problems += _async_save_problems(model_parts, cfg)
    problems += _checkpoint_problems(model_parts, cfg, dims, device)
    # Every rank stops together (a node's drives differ from another's), and no rank creates
    # its page files while another still measures the free space.
    refused = torch.tensor([len(problems)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(refused, op=dist.ReduceOp.MAX)
    if problems:
        raise ValueError("refused at start, before step 1:\n  - " + "\n  - ".join(problems))
    if int(refused.item()):
        raise ValueError("refused at start, before step 1, by another rank: see its error")


def _page_space_problems(model_parts: list[nn.Module], cfg: JobConfig) -> list[str]:
    tables = _nvme_tables(model_parts)
    if not tables:
        return []
    record, ranks = _record(cfg), _ranks_per_node()
    need: dict[int, int] = defaultdict(int)  # file system (st_dev) -> bytes of this node
    dirs_of: dict[int, list[str]] = defaultdict(list)
    for table in tables:
        dirs = list(table._engram_nvme.dirs)
        pages = page_file_bytes(_local(table.weight).shape[0], record) // page_layout(record)[0]
        for i, d in enumerate(dirs):
            fs = os.stat(filesystems.existing_parent(d)).st_dev
            per_file = -(-(pages - i) // len(dirs)) * page_layout(record)[0]
            need[fs] += ranks * per_file
            if d not in dirs_of[fs]:
                dirs_of[fs].append(d)
    problems, local_rank0 = [], int(os.environ.get("LOCAL_RANK", "0")) == 0
    for fs, dirs in dirs_of.items():
        have = filesystems.free_bytes(dirs[0]) + sum(dead_page_file_bytes(d) for d in dirs)
        where = f"on the file system of {', '.join(dirs)} ({ranks} rank(s) of this node)"
        problem = page_space_problem(need[fs], have, where, "it has free")
        problems += [problem] if problem else []
    for d in {d for dirs in dirs_of.values() for d in dirs} if local_rank0 else ():
        warning = filesystems.storage_warning(d)
        if warning:
            logger.warning(warning)
    if local_rank0:
        _warn_page_endurance(cfg, tables, list(dirs_of.values()))
    return problems


def _warn_page_endurance(cfg: JobConfig, tables: list, dir_groups: list[list[str]]) -> None:
    page, _ = page_layout(_record(cfg))
    per_step = _ranks_per_node() * _planned_pages_per_step(cfg, tables) * page
    drives = sum(filesystems.disk_bytes(dirs[0]) for dirs in dir_groups)
    dwpd = drive_writes_per_day(per_step, PLAN.step_time_s, drives)
    warning = endurance_warning(
        dwpd, PLAN.rated_dwpd, f"NVMe page write-backs (a {PLAN.step_time_s:g} s step assumed)"
    )
    if warning:
        logger.warning(warning)


def _state_bytes(model_parts: list[nn.Module], cfg: JobConfig, local: bool) -> tuple[int, int]:
    """(everything, tables) a checkpoint holds of these parts: parameters it saves (all, or
    with checkpoint.trainable_only the trainable ones) and their optimizer state."""
    spec = table_optimizer_spec(cfg.optimizer.table_optimizer)
    total = table = 0
    for part in model_parts:
        for name, p in part.named_parameters():
            if cfg.checkpoint.trainable_only and not p.requires_grad:
                continue
            is_table = is_table_param(name)
            t = _local(p) if local else p
            weight = t.numel() * t.element_size()
            state = 0
            if p.requires_grad:
                state = (
                    t.shape[0] * spec.state_bytes_per_row(t.shape[1]) if is_table else 8 * t.numel()
                )
            total += weight + state
            table += (weight + state) if is_table else 0
    return total, table


def _async_save_problems(model_parts: list[nn.Module], cfg: JobConfig) -> list[str]:
    if not (cfg.checkpoint.enable and cfg.checkpoint.async_mode == "async"):
        return []
    ranks = _ranks_per_node()
    staging, _ = _state_bytes(model_parts, cfg, local=True)
    readout = sum(_local(t.weight).shape[0] for t in _nvme_tables(model_parts)) * _record(cfg)
    other = sum(host_table_bytes(part, cfg.optimizer.table_optimizer) for part in model_parts)
    limit = cfg.engram.host_memory_gib
    have = int(limit * GIB) if limit > 0 else mem_available_bytes()
    source = f"engram.host_memory_gib = {limit:g}" if limit > 0 else "MemAvailable"
    problem = async_save_host_problem(ranks * (staging + readout), ranks * other, have, source)
    return [problem] if problem else []


def _checkpoint_problems(
    model_parts: list[nn.Module], cfg: JobConfig, dims: ParallelDims, device: torch.device
) -> list[str]:
    c = cfg.checkpoint
    if not c.enable:
        return []
    total, table = _state_bytes(model_parts, cfg, local=False)
    delta = _table_delta_bytes(model_parts, cfg) if c.table_full_every > 1 else 0
    sums = torch.tensor([total, table, delta], dtype=torch.int64, device=device)
    if dims.pp_enabled:  # each stage holds other layers: the model is their sum
        dist.all_reduce(sums, group=dims.mesh("pp").get_group())
    total, table, delta = (int(v) for v in sums.tolist())
    saves = -(-cfg.training.steps // c.interval)
    need = kept_checkpoint_bytes(total, total - table + delta, c.keep_latest_k,
                                 c.table_full_every, saves)  # fmt: skip
    folder = Path(cfg.run_folder) / c.folder
    have = filesystems.free_bytes(str(folder)) + _checkpoints_bytes(folder)
    problem = checkpoint_space_problem(need, have, str(folder), c.keep_latest_k)
    if problem:
        return [problem]
    if int(os.environ.get("RANK", "0")) == 0:
        per_save = (total + (c.table_full_every - 1) * (total - table + delta)) / c.table_full_every
        dwpd = drive_writes_per_day(per_save / c.interval, PLAN.step_time_s,
                                    filesystems.disk_bytes(str(folder)))  # fmt: skip
        warning = endurance_warning(
            dwpd, PLAN.rated_dwpd,
            f"checkpoint saves to {folder} (every {c.interval} steps of an assumed "
            f"{PLAN.step_time_s:g} s)",
        )  # fmt: skip
        if warning:
            logger.warning(warning)
    return []


def _table_delta_bytes(model_parts: list[nn.Module], cfg: JobConfig) -> int:
    """A delta save's table bytes (every owner's touched rows and their ids), by the planner's
    rule (capacity.touched_rows over TierAssumptions' reuse)."""
    record, ids = _record(cfg), _ids_per_owner(cfg)
    total = 0
    for table in (m for part in model_parts for m in part.modules()):
        if not isinstance(table, ShardedEngramTable):
            continue
        local = _local(table.weight).shape[0]
        owners = dist.get_world_size(table.lookup.group) if dist.is_initialized() else 1
        per_step = step_rows(PLAN.unique_rows_per_step, ids, local)
        rows = touched_rows(per_step, cfg.checkpoint.interval, PLAN.reuse_window, local)
        total += owners * rows * (record + ROW_ID_BYTES)
    return total


def _checkpoints_bytes(folder: Path) -> int:
    """Bytes the checkpoints already in `folder` take (a resumed run prunes and replaces them)."""
    total = 0
    for step_dir in folder.glob("step-*") if folder.is_dir() else ():
        for root, _, files in os.walk(step_dir):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


# ----------------------------------------------------------------------------- after init


def report_tiers(model_parts: list[nn.Module], cfg: JobConfig) -> None:
    """One line per rank for host / NVMe tables (rank 0 logs them all), and the drive probe's
    warning (module docstring). Collective when any rank has such tables."""
    if not cfg.engram.enabled or cfg.engram.table_location == "device":
        return
    tables = _host_tables(model_parts)
    nvme = _nvme_tables(model_parts)
    rank = dist.get_rank() if dist.is_initialized() else 0
    line = _nvme_line(cfg, nvme) if nvme else _host_line(cfg, tables)
    lines = [f"rank {rank}: {line}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, lines[0])
        lines = gathered
    for one in lines if rank == 0 else ():
        logger.info("table tier: %s", one)


def _host_line(cfg: JobConfig, tables: list[HostShardedEngramTable]) -> str:
    held = sum(host_table_bytes(t, cfg.optimizer.table_optimizer) for t in tables)
    return (
        f"{len(tables)} host table(s): {held / GIB:.3f} GiB of shards, "
        f"{cfg.optimizer.table_optimizer} state and staging in host memory"
    )


def _nvme_line(cfg: JobConfig, tables: list[NvmeShardedEngramTable]) -> str:
    stores = [t.spill() for t in tables]
    first = stores[0]
    dirs = list(tables[0]._engram_nvme.dirs)
    kinds = [getattr(filesystems.mount_of(d), "fstype", "?") for d in dirs]
    file_bytes = sum(os.path.getsize(p) for s in stores for p in s.paths)
    rate = probe_random_reads(dirs[0], cfg.engram.nvme_probe_s, first.direct)
    if cfg.engram.nvme_probe_s > 0:
        warning = probe_warning(
            rate, _planned_pages_per_step(cfg, tables), first.page_bytes, PLAN.step_time_s,
            dirs[0],
        )  # fmt: skip
        if warning:
            logger.warning(warning)
    io = "O_DIRECT" if first.direct else f"buffered ({first.io.buffered_why})"
    probe = f"; probe {rate:,.0f} random 4 KiB reads/s" if cfg.engram.nvme_probe_s > 0 else ""
    return (
        f"{len(tables)} NVMe table(s), page files {file_bytes / GIB:.3f} GiB in "
        f"{', '.join(f'{d} ({k})' for d, k in zip(dirs, kinds, strict=True))}; host cache "
        f"{first.cache_pages * first.page_bytes / GIB:.3f} GiB per table; records "
        f"{4 * first.record_floats} B, {first.rows_per_page} per {first.page_bytes} B page; "
        f"page I/O {first.io.engine}, {io}{probe}"
    )
