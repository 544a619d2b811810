"""Context parallelism on this machine: per-rank activation memory and step time at CP 1 / 2 / 4,
and the bytes each method moves per layer against the planner's prediction.

    python benchmarks/bench_cp.py [--seq 2048] [--steps 3]

A debug-sized llama (dim 256, 4 layers, 8 heads x 32, 4 KV heads so Ulysses can run at cp 4,
FFN 768, Engram at layer 1 as in debug_model.toml), fp32, one sequence of `--seq` tokens,
forward + backward of the summed logits' mean, gloo ranks forked on this CPU (one thread each).
Only `apply_context_parallel` is applied (no FSDP, no table sharding), so the numbers are
those of context parallelism itself:

- activations: the bytes autograd keeps for backward on each rank at the end of the forward
  (distinct storages seen by saved_tensors_hooks, parameters excluded; all-gather K/V's
  additive masks included: SDPA saves them), against planner.activations.activation_estimate;
- step: the median forward + backward wall time over `--steps` steps after one warm-up (with
  4 ranks on 2 cores the ranks share cores: read the times as an upper bound);
- bytes: what each rank receives from the cp collectives in one step, counted at the dispatcher
  (all-to-all: (cp - 1) / cp of its input; all-gather: (cp - 1) x its input; reduce-scatter:
  (cp - 1) / cp of its input), split into attention (4-D tensors) and the Engram halo (3-D),
  per layer, against planner.comm.cp_layer_bytes (forward + backward = 2 x the forward).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_engram_tables import launch  # noqa: E402

from engram.config import load_config  # noqa: E402
from engram.data.tokenizer import load_tokenizer  # noqa: E402
from engram.hashing.ngram import NgramHasher  # noqa: E402
from engram.models.args import ModelArgs  # noqa: E402
from engram.models.transformer import Transformer  # noqa: E402
from parallelisms.context_parallel import apply_context_parallel, split_batch  # noqa: E402
from parallelisms.parallel_dims import ParallelDims  # noqa: E402
from planner.activations import activation_estimate  # noqa: E402
from planner.comm import cp_layer_bytes  # noqa: E402

ARGS = ModelArgs(
    dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, head_dim=32, max_seq_len=1 << 16
)
MIB = 2**20


class CpBytes(TorchDispatchMode):
    """Bytes this rank receives from functional collectives: attention (tensors of 4 or more
    dims) and halo (3-D) per kind; everything else (the loss's scalars) apart."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = {"attention": 0, "halo": 0, "other": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if func.namespace == "_c10d_functional" and not name.startswith("wait"):
            t = args[0]
            n = t.numel() * t.element_size()
            if name.startswith("all_to_all_single"):
                size = dist.get_world_size()  # the cp group is the world here
                got = n * (size - 1) // size
            elif name.startswith("all_gather_into_tensor"):
                got = n * (args[1] - 1)
            elif name.startswith("reduce_scatter_tensor"):
                got = n * (args[2] - 1) // args[2]
            else:
                got = 0
            kind = "attention" if t.dim() >= 4 else "halo" if t.dim() == 3 else "other"
            self.bytes[kind] += got
        return func(*args, **(kwargs or {}))


def _worker(rank: int, world: int, method: str, cfg, seq: int, steps: int) -> dict:
    torch.set_num_threads(1)
    tok = load_tokenizer("")
    hasher = NgramHasher.from_config(cfg.engram, tok, tok.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tok.vocab_size, (1, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids, "hash_ids": torch.from_numpy(hasher(ids.numpy()))}
    dims = ParallelDims(1, 1, 1, 1, world, cp=world, cp_method=method)
    dims.check_model(ARGS, seq, engram_halo=(cfg.engram.kernel_size - 1) * cfg.engram.max_ngram)
    dims.build_mesh("cpu")
    args = dataclasses.replace(ARGS, vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    model = Transformer(args, cfg.engram, dict(hasher.table_rows))
    model.init_weights(seed=0)
    apply_context_parallel(model, dims)
    part = split_batch(batch, dims)

    def step(hooks: bool = False, counter: CpBytes | None = None) -> int:
        held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        saved: dict[int, int] = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with ctx if hooks else nullcontext(), counter or nullcontext():
            logits = model(
                part["input_ids"], hash_ids=part["hash_ids"], positions=part["positions"]
            )
            logits.float().mean().backward()
        model.zero_grad(set_to_none=True)
        return sum(n for p, n in saved.items() if p not in held)

    saved = step(hooks=True)  # also the warm-up
    counter = CpBytes()
    step(counter=counter)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"saved": saved, "bytes": counter.bytes, "step_s": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    opts = p.parse_args()
    cfg = load_config(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            f"--training.seq_len={opts.seq}",
            "--training.local_batch_size=1",
        ]
    )
    args = dataclasses.replace(ARGS, vocab_size=load_tokenizer("").vocab_size)
    engram_layers = len(cfg.engram.layer_ids)
    print(
        f"llama dim {ARGS.dim}, {ARGS.n_layers} layers, {ARGS.n_heads} heads x {ARGS.head_dim} "
        f"({ARGS.n_kv_heads} KV), Engram at layers {cfg.engram.layer_ids}, fp32, 1 x {opts.seq} "
        "tokens; per rank (mean over ranks)\n"
    )
    print(
        "| cp | method | saved activations MiB (planner) | vs cp 1 | step s | attention bytes "
        "/ layer / step (planner) | halo bytes / Engram layer / step (planner) |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for cp, method in ((1, "ulysses"), (2, "ulysses"), (2, "allgather_kv"), (4, "ulysses"),
                       (4, "allgather_kv")):  # fmt: skip
        res = launch(_worker, cp, method, cfg, opts.seq, opts.steps)
        saved = statistics.mean(r["saved"] for r in res)
        base = base or saved
        act = activation_estimate(cfg, args, "float32", cp=cp, cp_method=method)
        predicted = act.saved_bytes
        dims = ParallelDims(1, 1, 1, 1, cp, cp=cp, cp_method=method)
        attn, halo = cp_layer_bytes(args, cfg.engram, dims, 1, opts.seq, 4)
        got_attn = statistics.mean(r["bytes"]["attention"] for r in res) / ARGS.n_layers
        got_halo = statistics.mean(r["bytes"]["halo"] for r in res) / engram_layers
        print(
            f"| {cp} | {method if cp > 1 else '-'} | {saved / MIB:.1f} ({predicted / MIB:.1f}) | "
            f"{saved / base:.2f} | {statistics.mean(r['step_s'] for r in res):.2f} | "
            f"{got_attn:,.0f} ({2 * attn:,}) | {got_halo:,.0f} ({2 * halo:,}) |"
        )


if __name__ == "__main__":
    main()
