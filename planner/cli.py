"""The planner's command line (scripts/estimate_memory.py runs main): flags, the config, and
the estimate or the layout comparison printed as markdown or JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from engram.config import ConfigError, load_config
from engram.runtime.device_specs import DEVICE_MODELS, device_memory_gib
from planner.compare import Row, compare
from planner.estimate import estimate
from planner.nvme import add_tier_flags, tier_assumptions
from planner.report import compare_markdown, to_markdown
from planner.results import MemoryEstimate
from planner.step_model import MACHINES


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description="Fake-backend dry run: per-rank memory of a config at its real world size. "
        "Other arguments (--job.config_file PATH, --section.key=value) go to the job config."
    )
    _estimate_flags(p)
    _host_table_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    _compare_flags(p)
    _step_model_flags(p)
    return p.parse_known_args(argv)


def _estimate_flags(p: argparse.ArgumentParser) -> None:
    """The world, the ranks to report and the memory budget's assumptions."""
    p.add_argument("--world_size", type=int, required=True, help="processes (NNODES x NGPU)")
    p.add_argument(
        "--ranks", default="", help="comma-separated ranks, or 'all' (default: 0,1,W/2,W-1)"
    )
    p.add_argument(
        "--device_memory_gib",
        type=float,
        default=None,
        help="device memory budget, GiB; default: the usable memory of --device, else of "
        "job.device (npu 60.96, cuda 79.11: what the device reports to PyTorch, not the nameplate; "
        "engram/runtime/device_specs.py), else the npu figure",
    )
    p.add_argument(
        "--device",
        default="",
        help="plan for this device: a type (cuda, npu) or a model (h200, b200, h100, a100-40gb, "
        "910b2, 910c, ...: engram/runtime/device_specs.py PEAK_SPECS): its usable memory is the "
        "budget (unless --device_memory_gib) and, with --compare, its dense bf16 peak the step "
        "model's (unless --peak_tflops)",
    )
    p.add_argument("--fragmentation", type=float, default=0.10, help="allocator overhead fraction")
    p.add_argument(
        "--reserve_gib", type=float, default=3.0, help="runtime context + HCCL/NCCL buffers"
    )
    p.add_argument(
        "--sync_every_micro_batch",
        action="store_true",
        help="model reduce-scatter after every micro-batch instead of the recipe's no-sync "
        "gradient accumulation",
    )


def _host_table_flags(p: argparse.ArgumentParser) -> None:
    """Host-resident Engram tables: host memory per node, the host link, the locations
    --compare tries."""
    p.add_argument(
        "--host_memory_gib",
        type=float,
        default=None,
        help="host memory per node for host-resident Engram tables (default: "
        "engram.host_memory_gib; 0: not checked)",
    )
    p.add_argument(
        "--host_link_gbs",
        type=float,
        default=25.0,
        help="assumed host <-> device GB/s per device for host tables' rows and row gradients",
    )
    p.add_argument(
        "--table_locations",
        default="",
        help="with --compare: engram.table_location values to try per layout, e.g. device,host "
        "(default: the config's)",
    )
    add_tier_flags(p)  # NVMe tables and table checkpoints: hardware and reuse assumptions


def _compare_flags(p: argparse.ArgumentParser) -> None:
    """--compare and the candidates it tries: layouts, CP, micro-batch sizes, loss chunks."""
    p.add_argument(
        "--compare",
        action="store_true",
        help="print candidate layouts side by side (planner/compare.py) instead",
    )
    p.add_argument(
        "--layouts",
        default="",
        help="with --compare: comma-separated layouts, e.g. FSDP64,HSDP8x8,PP2xTP4xFSDP8 "
        "(default: the usual candidates for the world size)",
    )
    p.add_argument(
        "--node_size", type=int, default=8, help="with --compare: devices per node (TP <= this)"
    )
    p.add_argument(
        "--cp",
        default="",
        help="with --compare: context-parallel degrees whose layouts (CP<c>xFSDP<W/c>, "
        "CP<c>xTP<t>xFSDP...) join the default candidates, e.g. 2,4,8",
    )
    p.add_argument(
        "--cp_methods",
        default="",
        help="with --compare: parallelism.cp_method values to try for layouts with CP, e.g. "
        "ulysses,allgather_kv (default: the config's)",
    )
    p.add_argument(
        "--local_batch_sizes",
        default="",
        help="with --compare: micro-batch sizes (sequences) to try for layouts without PP, e.g. "
        "1,2,4 (default: the config's training.local_batch_size)",
    )
    p.add_argument(
        "--loss_chunks",
        default="",
        help="with --compare: training.loss_chunks values to try, e.g. 1,8 (default: the config's)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=0.15,
        help="with --compare: the pick needs this fraction of device memory free",
    )


def _step_model_flags(p: argparse.ArgumentParser) -> None:
    """--compare's step model: the machine's assumed speeds (planner/step_model.py)."""
    for flag, what in (
        ("peak_tflops", "dense bf16 TFLOPS per device"),
        ("mfu", "model FLOPs utilisation"),
        ("inter_node_gbs", "GB/s per device between nodes"),
        ("intra_node_gbs", "GB/s per device inside a node"),
    ):
        p.add_argument(
            f"--{flag}", type=float, default=None, help=f"with --compare: {what} (step model)"
        )


def _parse_ranks(text: str, world_size: int) -> list[int] | None:
    if not text:
        return None
    if text == "all":
        return list(range(world_size))
    try:
        return [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(
            f"--ranks must be comma-separated integers or 'all', got {text!r}"
        ) from None


def apply_device(opts: argparse.Namespace) -> None:
    """--device: fill in the budget and the step model's peak it implies (what the user gave
    explicitly wins); an unknown name is an error naming the valid ones."""
    if not opts.device:
        return
    try:
        budget = device_memory_gib(opts.device)
    except ValueError as e:
        raise ConfigError(f"--device: {e}") from None
    if opts.device_memory_gib is None:
        opts.device_memory_gib = budget
    model = DEVICE_MODELS.get(opts.device.lower())
    if model is not None and opts.peak_tflops is None:
        opts.peak_tflops = model.bf16_tflops


def main(argv: list[str] | None = None) -> MemoryEstimate | list[Row]:
    opts, rest = parse_args(list(sys.argv[1:] if argv is None else argv))
    apply_device(opts)
    cfg = load_config(rest)
    if opts.compare:
        machine = MACHINES.get(cfg.job.device, MACHINES["cuda"])
        machine = dataclasses.replace(
            machine,
            **{
                k: getattr(opts, k)
                for k in ("peak_tflops", "mfu", "inter_node_gbs", "intra_node_gbs")
                if getattr(opts, k) is not None
            },
        )
        rows = compare(
            cfg,
            opts.world_size,
            [name for name in opts.layouts.split(",") if name] or None,
            opts.node_size,
            machine,
            [int(n) for n in opts.local_batch_sizes.split(",") if n] or None,
            [int(n) for n in opts.loss_chunks.split(",") if n] or None,
            table_locations=[loc for loc in opts.table_locations.split(",") if loc] or None,
            cps=[int(c) for c in opts.cp.split(",") if c] or None,
            cp_methods=[m for m in opts.cp_methods.split(",") if m] or None,
            device_memory_gib=opts.device_memory_gib,
            fragmentation=opts.fragmentation,
            reserve_gib=opts.reserve_gib,
            ranks_per_node=opts.node_size,
            host_memory_gib=opts.host_memory_gib,
            host_link_gbs=opts.host_link_gbs,
            tier=tier_assumptions(opts),
        )
        print(compare_markdown(cfg, opts.world_size, rows, opts.node_size, machine, opts.margin))
        return rows
    est = estimate(
        cfg,
        opts.world_size,
        _parse_ranks(opts.ranks, opts.world_size),
        opts.device_memory_gib,
        opts.fragmentation,
        opts.reserve_gib,
        opts.sync_every_micro_batch,
        ranks_per_node=opts.node_size,
        host_memory_gib=opts.host_memory_gib,
        host_link_gbs=opts.host_link_gbs,
        tier=tier_assumptions(opts),
    )
    print(json.dumps(est.to_dict(), indent=2) if opts.json else to_markdown(est))
    return est
