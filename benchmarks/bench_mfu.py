"""MFU of a mid-size model with Engram off and on, against this machine's measured GEMM peak; or
of any config's real-width cut, against the memory planner.

    python benchmarks/bench_mfu.py                          # this CPU: ~2 min on 2 idle cores
    torchrun --nproc_per_node=8 benchmarks/bench_mfu.py     # a GPU / NPU node: FSDP-8, bf16
    python benchmarks/bench_mfu.py --config train_configs/8b_gpu.toml --layers 4 \
        --parallelism.tp=1 [--section.key=value ...]        # a config's cut (below)
    python benchmarks/bench_mfu.py --telemetry [--steps 24]  # Engram telemetry on / off (below)

With --config: the config's model cut to --layers decoder layers (one Engram layer kept, with its
full tables; runner/trial_step.py cut_config) at the config's layout, compute dtype
(parallelism.mixed_precision_param), activation checkpointing, compile / float8, loss and
optimizers, stepped by the recipe's one step (runner/step.py) on synthetic batches. Printed:
the cut, step time, tokens/s, TFLOP/s and MFU per device, and rank 0's peak memory against the
planner's plan for the same cut (live tensors, no fragmentation / reserve: scripts/cluster_step.py).
On accelerators the widths, sequence and batch are the config's; on cpu they shrink (widths / 16,
tables / 1000, seq <= 256: the output says so), so a cpu run checks the plumbing, not the speed.

Without --config:

1. The peak: square GEMMs timed on this device (float32 on cpu, bfloat16 on accelerators), and
   on accelerators the dense bf16 figure of engram/runtime/device_specs.py beside it. MFU divides
   by the measured peak on cpu and by the table's on accelerators (as training logs it).
2. A 256M-parameter Llama-shaped model (dim 1024, 16 layers, 16 heads / 8 KV, FFN 2816,
   vocabulary 32768), seq 1024, trained a few steps with the recipe's own placement, optimizers
   and step (runner/trial_step.py, synthetic batches), Engram off, then on (one Engram
   layer at layer 1, 2 orders x 8 heads x 64, tables of 2 x 8 x ~32 K rows, dense Adam). The last
   step of each is timed (cpu: the only one); FLOPs per token as engram/train/flops.py counts them.
3. The table: step time, tokens/s, TFLOP/s and MFU per device, the share of the CPU threads the
   step got (cpu: a machine shared with other jobs shows here, not as a slow kernel), and the
   on / off ratios.

With --telemetry: the Engram-on model of 2., one instance, stepped --steps times with the
log-step telemetry (engram/train/telemetry.py: the blocks' gate sums, the table update's
statistics, the one all-reduce and host read) and --steps times without, alternating step by
step (the loss is read on both, as every log step does); medians, and the overhead per log step
and per step at metrics.log_freq = 10 (docs/benchmarks.md, "Telemetry overhead").
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engram.config import config_from_dict, load_config  # noqa: E402
from engram.models.args import MODEL_FLAVORS, ModelArgs  # noqa: E402
from engram.runtime import device as dev  # noqa: E402
from engram.runtime.device_specs import measure_gemm_tflops, peak_spec_for  # noqa: E402
from engram.runtime.distributed import destroy_distributed, init_distributed  # noqa: E402
from engram.runtime.logs import init_logging  # noqa: E402
from parallelisms.parallel_dims import parallel_dims_from_config  # noqa: E402
from runner.trial_step import Trial, cut_config, run_trial_step  # noqa: E402
from scripts.cluster_step import GIB, planner_peak_gib  # noqa: E402

FLAVOR = "bench-256M"
MODEL_FLAVORS["llama3"][FLAVOR] = ModelArgs(
    dim=1024, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=2816, vocab_size=32768,
    rope_theta=500000.0, max_seq_len=1024,
)  # fmt: skip
ENGRAM = {
    "layer_ids": [1], "max_ngram": 3, "n_head_per_ngram": 8, "n_embed_per_ngram": 512,
    "vocab_size_per_ngram": [32768, 32768],
}  # fmt: skip


def run(engram: bool, args, device, peak_tflops: float) -> dict:
    cfg = config_from_dict(
        {
            "job": {"device": device.type},
            "model": {"name": "llama3", "flavor": FLAVOR},
            "engram": {**ENGRAM, "enabled": engram},
            "training": {"seq_len": args.seq, "local_batch_size": args.batch},
            "parallelism": {"mixed_precision_param": args.dtype},
            "metrics": {"peak_tflops": peak_tflops},
        }
    )
    dims = parallel_dims_from_config(cfg, dist.get_world_size())
    dims.build_mesh(device.type)
    step = run_trial_step(cfg, dims, device, steps=args.steps)
    tokens = args.seq * args.batch / step.step_time_s  # per device: every rank holds its batch
    return {"step": step, "tokens_per_s": tokens}


def run_config(args, cfg_argv: list[str], device) -> list[str]:
    """--config: the cut's one step, against the planner's peak for the same cut."""
    cfg = load_config(cfg_argv)
    world, cpu = dist.get_world_size(), device.type == "cpu"
    dims = parallel_dims_from_config(cfg, world)
    cut, what = cut_config(cfg, args.layers, cpu, dims.tp, dims.pp, dims.cp)
    planned, note = None, ""
    if dist.get_rank() == 0:
        try:
            planned = planner_peak_gib(cfg_argv, world, args.layers, cpu)
        except Exception as e:  # the step still runs; the table says why there is no ratio
            note = f" (no plan: {type(e).__name__}: {e})"
    dims.build_mesh(device.type)
    step = run_trial_step(cut, dims, device, steps=args.steps)
    t = cut.training
    tokens = t.local_batch_size * t.seq_len * dims.dp_size / step.step_time_s / world
    measured = step.peak_bytes / GIB
    ratio = f"{measured / planned:.2f}" if planned else "-"
    return [
        f"device {dev.device_name(device)} ({device.type}, world {world}), torch "
        f"{torch.__version__}; layout {dims}",
        f"{what}" + ("; SHRUNK on cpu: not the config's speed or memory" if cpu else ""),
        f"compute dtype {cut.parallelism.mixed_precision_param}, compile "
        f"{cut.compile.enable}, float8 {cut.float8.enable}; timed step {args.steps} of "
        f"{args.steps}; MFU of the {step.peak.source} peak {step.peak.tflops:.3g} TFLOP/s",
        "| step s | tokens/s per device | TFLOP/s per device | MFU | peak GiB (rank 0) "
        "| planned GiB | measured / planned |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {step.step_time_s:.3f} | {tokens:,.0f} | {step.tflops:.3g} | {step.mfu:.1f}% | "
        f"{measured:.2f}{' (cpu: resident-set growth)' if cpu else ''} | "
        f"{f'{planned:.2f}' if planned else '-'} | {ratio} |{note}",
    ]


def telemetry_overhead(args, device) -> list[str]:
    """--telemetry: the Engram-on model's step with the log-step telemetry read (Progress's
    loss read on both) and without, alternating step by step on one model, so a loaded
    machine's noise hits both alike; medians after two warm-up steps each."""
    cfg = config_from_dict(
        {
            "job": {"device": device.type},
            "model": {"name": "llama3", "flavor": FLAVOR},
            "engram": {**ENGRAM, "enabled": True},
            "training": {"seq_len": args.seq, "local_batch_size": args.batch, "steps": 10**6},
            "parallelism": {"mixed_precision_param": args.dtype},
            "metrics": {"log_freq": 1},  # every step a log step: on pays it every step
        }
    )
    dims = parallel_dims_from_config(cfg, dist.get_world_size())
    dims.build_mesh(device.type)
    trial = Trial(cfg, dims, device)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * (args.steps + 2)):
        on = i % 2 == 1
        trial.train_step.telemetry.enabled = on
        timed = trial.timed_step()
        if i >= 4:
            times[on].append(timed.wall_s)
        if dist.get_rank() == 0:  # progress: a long run on a loaded machine shows it
            print(f"step {i + 1}: telemetry {'on' if on else 'off'} {timed.wall_s:.4f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
    off, on = statistics.median(times[False]), statistics.median(times[True])
    extra = (on - off) / off
    return [
        f"model llama3/{FLAVOR} + Engram at layer 1, seq {args.seq}, batch {args.batch} per "
        f"rank, {args.dtype}; {args.steps} steps each, alternating, after 2 warm-up steps each",
        "| telemetry | median step s | min | max |",
        "| --- | --- | --- | --- |",
        *[
            f"| {'on (every step a log step)' if k else 'off'} | {statistics.median(v):.4f} "
            f"| {min(v):.4f} | {max(v):.4f} |"
            for k, v in ((False, times[False]), (True, times[True]))
        ],
        f"on / off: x{on / off:.4f} at metrics.log_freq = 1 ({100 * extra:+.2f}% per log "
        f"step); at log_freq = 10: {100 * extra / 10:+.3f}% of step time",
    ]


def share(step) -> str:
    """cpu: the share of this process's threads' time the timed step got (a loaded machine
    shows here, not as a slow kernel)."""
    threads = torch.get_num_threads()
    return f"{100 * step.cpu_time_s / (step.step_time_s * threads):.0f}% of {threads}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="", help="a TOML config: bench its cut (see above)")
    ap.add_argument("--layers", type=int, default=4, help="--config: decoder layers kept")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--steps", type=int, default=0, help="per variant, the last timed (0: 1 on cpu, else 3)"
    )
    ap.add_argument("--threads", type=int, default=2, help="cpu threads")
    ap.add_argument("--dtype", default="", help="FSDP compute dtype (default: bf16 off cpu)")
    ap.add_argument(
        "--telemetry", action="store_true", help="time the log-step telemetry on / off (above)"
    )
    args, overrides = ap.parse_known_args()
    if overrides and not args.config:
        ap.error(f"unknown arguments {overrides} (--section.key=value needs --config)")
    device_type = dev.resolve_device_type(args.device)
    # --config: the config file, this machine's device type (the 8B/32B GPU configs name cuda)
    # unless an override names one, then the overrides.
    cfg_argv = [f"--job.config_file={args.config}", f"--job.device={device_type}", *overrides]
    args.dtype = args.dtype or ("float32" if device_type == "cpu" else "bfloat16")
    # cpu: one ~40 s step per variant (a warm-up step would double the run); accelerators: the
    # first steps pay for kernel selection and allocator growth.
    args.steps = args.steps or (24 if args.telemetry else 1 if device_type == "cpu" else 3)
    if device_type == "cpu":
        torch.set_num_threads(args.threads)
    dev.import_device_backend(device_type)
    rank, local_rank, world = init_distributed(device_type)
    init_logging(rank)
    device = dev.local_device(device_type, local_rank)
    try:
        if args.config or args.telemetry:
            run_one = run_config if args.config else lambda a, _, d: telemetry_overhead(a, d)
            lines = run_one(args, cfg_argv, device)
            if dist.get_rank() == 0:
                print("\n".join(lines), flush=True)
            return
        gemm_dtype = torch.float32 if device_type == "cpu" else torch.bfloat16
        n = 512 if device_type == "cpu" else 8192
        measured = measure_gemm_tflops(device, gemm_dtype, n=n, budget_s=1.0)
        name = dev.device_name(device)
        spec = peak_spec_for(name) if device_type != "cpu" else None
        peak = spec.bf16_tflops if spec else measured
        lines = [
            f"device {name} ({device_type}, world {world}), torch {torch.__version__}",
            f"measured GEMM peak: {measured:.3g} TFLOP/s ({str(gemm_dtype)[6:]}, {n}^3)"
            + (f"; table: {spec.bf16_tflops:g} ({spec.name})" if spec else ""),
            f"MFU divides by {peak:.3g} TFLOP/s ({'table' if spec else 'measured'})",
        ]
        rows = {e: run(e, args, device, peak) for e in (False, True)}
        off, on = rows[False], rows[True]
        lines += [
            "",
            f"model llama3/{FLAVOR}, seq {args.seq}, batch {args.batch} per rank, "
            f"{args.dtype}, timed step {args.steps} of {args.steps}",
            "| Engram | FLOPs / token | step s | tokens/s per device | TFLOP/s | MFU | CPU share |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for label, r in (("off", off), ("on", on)):
            s = r["step"]
            lines.append(
                f"| {label} | {s.flops.per_token / 1e9:.3f} G | {s.step_time_s:.2f} | "
                f"{r['tokens_per_s']:,.0f} | {s.tflops:.3g} | {s.mfu:.1f}% | {share(s)} |"
            )
        lines.append(
            f"on / off: MFU x{on['step'].mfu / off['step'].mfu:.3f}, tokens/s "
            f"x{on['tokens_per_s'] / off['tokens_per_s']:.3f}, CPU seconds per step "
            f"x{on['step'].cpu_time_s / off['step'].cpu_time_s:.3f}"
        )
        if dist.get_rank() == 0:
            print("\n".join(lines), flush=True)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
