"""check_cluster.py's `real_step` row: one real training step of the config's cut, against the
memory planner's prediction for the same cut.

    rank 0: the planner's peak for the cut (in a child process: the planner plays ranks under
            torch's fake process group, which cannot coexist with the job's real one)
    every rank: runner/trial_step.py (the recipe's placement, optimizers and step: runner/step.py)
    printed: what was cut, step time, TFLOP/s and MFU per device, rank 0's peak memory against
            the planner's (the ratio is the planner's error on this hardware)

The planner is asked for live tensors only (no fragmentation, no reserve): the measured figure
is the allocator's peak of active bytes. On cpu the measurement is the resident-set growth of
the build and the steps (approximate) and the widths are shrunk, so the ratio there checks the
plumbing, not the planner. Run alone, this file is that child process:

    python scripts/cluster_step.py --world W --layers L [--cpu] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engram.config import load_config  # noqa: E402

GIB = float(1 << 30)


def planner_peak_gib(cfg_argv: list[str], world: int, layers: int, cpu: bool) -> float:
    """The planner's peak of live tensors on rank 0 for the cut, GiB (runs this file)."""
    cmd = [sys.executable, __file__, "--world", str(world), "--layers", str(layers)]
    proc = subprocess.run(
        cmd + (["--cpu"] if cpu else []) + cfg_argv,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"planner failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_gib"]


def real_step(cfg, cfg_argv: list[str], device, layers: int) -> str:
    """The row's text on rank 0 ("" elsewhere); raises if the step fails on this rank."""
    import torch.distributed as dist

    from parallelisms.parallel_dims import parallel_dims_from_config
    from runner.trial_step import cut_config, run_trial_step

    world, cpu = dist.get_world_size(), device.type == "cpu"
    dims = parallel_dims_from_config(cfg, world)
    cut, what = cut_config(cfg, layers, cpu, dims.tp, dims.pp, dims.cp)
    planned, note = None, ""
    if dist.get_rank() == 0:
        try:
            planned = planner_peak_gib(cfg_argv, world, layers, cpu)
        except Exception as e:  # the step still runs; the row says why there is no ratio
            note = f"; no planner ratio ({type(e).__name__}: {e})"
    dims.build_mesh(device.type)
    step = run_trial_step(cut, dims, device)
    if dist.get_rank() != 0:
        return ""
    measured = step.peak_bytes / GIB
    memory = f"rank 0 peak memory {measured:.2f} GiB"
    if planned:
        memory += f" vs planner {planned:.2f} GiB: ratio {measured / planned:.2f}"
    if cpu:
        memory += " (cpu: resident-set growth, approximate)"
    return (
        f"{what}: step {step.step_time_s:.2f} s, {step.tflops:.3g} TFLOP/s per device, MFU "
        f"{step.mfu:.1f}% of the {step.peak.source} peak {step.peak.tflops:.3g}; {memory}{note}"
    )


def main(argv: list[str] | None = None) -> None:
    from parallelisms.parallel_dims import parallel_dims_from_config
    from planner.estimate import estimate
    from runner.trial_step import cut_config

    parser = argparse.ArgumentParser(description="the planner's peak for check_cluster's cut")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--cpu", action="store_true")
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(rest)
    dims = parallel_dims_from_config(cfg, args.world)
    cut, _ = cut_config(cfg, args.layers, args.cpu, dims.tp, dims.pp, dims.cp)
    result = estimate(cut, args.world, ranks=[0], fragmentation=0.0, reserve_gib=0.0)
    print(json.dumps({"peak_gib": result.ranks[0].peak_bytes / GIB}))


if __name__ == "__main__":
    main()
