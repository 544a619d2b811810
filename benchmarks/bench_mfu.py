"""MFU of a mid-size model with Engram off and on, against this machine's measured GEMM peak.

    python benchmarks/bench_mfu.py                          # this CPU: ~2 min on 2 idle cores
    torchrun --nproc_per_node=8 benchmarks/bench_mfu.py     # a GPU / NPU node: FSDP-8, bf16

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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engram.config import config_from_dict  # noqa: E402
from engram.models.args import MODEL_FLAVORS, ModelArgs  # noqa: E402
from engram.runtime import device as dev  # noqa: E402
from engram.runtime.device_specs import measure_gemm_tflops, peak_spec_for  # noqa: E402
from engram.runtime.distributed import destroy_distributed, init_distributed  # noqa: E402
from parallelisms.parallel_dims import parallel_dims_from_config  # noqa: E402
from runner.trial_step import run_trial_step  # noqa: E402

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


def share(step) -> str:
    """cpu: the share of this process's threads' time the timed step got (a loaded machine
    shows here, not as a slow kernel)."""
    threads = torch.get_num_threads()
    return f"{100 * step.cpu_time_s / (step.step_time_s * threads):.0f}% of {threads}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--steps", type=int, default=0, help="per variant, the last timed (0: 1 on cpu, else 3)"
    )
    ap.add_argument("--threads", type=int, default=2, help="cpu threads")
    ap.add_argument("--dtype", default="", help="FSDP compute dtype (default: bf16 off cpu)")
    args = ap.parse_args()
    device_type = dev.resolve_device_type(args.device)
    args.dtype = args.dtype or ("float32" if device_type == "cpu" else "bfloat16")
    # cpu: one ~40 s step per variant (a warm-up step would double the run); accelerators: the
    # first steps pay for kernel selection and allocator growth.
    args.steps = args.steps or (1 if device_type == "cpu" else 3)
    if device_type == "cpu":
        torch.set_num_threads(args.threads)
    dev.import_device_backend(device_type)
    _, local_rank, world = init_distributed(device_type)
    device = dev.local_device(device_type, local_rank)
    try:
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
