"""Engram tables: per-rank memory and bytes communicated per step, row-sharded vs replicated.

Runs real gloo ranks (forked on this machine) and counts the actual payload of every collective
through a dispatch mode that sees each c10d op:

  sharded     this repo's all-to-all lookup (parallelisms/engram_tables/lookup.py), dedup on and off:
              counts + ids out, rows back (forward), row gradients back (backward). Bytes sent
              to OTHER ranks are counted (the self-chunk of an all-to-all never leaves the rank).
  replicated  a plain full table on every rank + a dense full-table gradient all-reduce (what
              DDP / ZeRO-1/2 do with a plain embedding). The all-reduced tensor is measured;
              a ring all-reduce moves 2 (W-1)/W of it per rank.

Ids come from the real NgramHasher (Engram layer 1) over a Zipf-distributed token stream (a
stand-in for natural text: a few tokens are very frequent), B x T tokens per rank per step.
Memory per rank = tensor bytes of the table parameter + its dense gradient + Adam's two moments
(fp32 everywhere, 16 B/param; Adam states measured by stepping LazyAdam when small enough).

    python benchmarks/bench_engram_tables.py                       # all configs, worlds 2 and 4
    python benchmarks/bench_engram_tables.py --configs debug --worlds 2
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import socket
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engram.hashing.ngram import NgramHasher
from engram.optim.lazy_adam import LazyAdam
from parallelisms.engram_tables import local_row_range, sharded_embedding_lookup

FP32 = 4
ID_BYTES = 8


@dataclass(frozen=True)
class TableConfig:
    vocab_size_per_ngram: tuple[int, ...]
    n_head_per_ngram: int
    n_embed_per_ngram: int
    vocab_size: int  # tokenizer vocabulary the token stream is drawn from
    run_replicated: bool  # False where a replicated table on every rank would not fit here

    @property
    def head_dim(self) -> int:
        return self.n_embed_per_ngram // self.n_head_per_ngram

    def hasher(self) -> NgramHasher:
        return NgramHasher(
            layer_ids=[1],
            max_ngram=len(self.vocab_size_per_ngram) + 1,
            n_head_per_ngram=self.n_head_per_ngram,
            vocab_size_per_ngram=list(self.vocab_size_per_ngram),
            seed=0,
            pad_id=0,
            lookup=None,
            vocab_size=self.vocab_size,
        )


CONFIGS = {
    # train_configs/debug_model.toml's Engram layer (debug tokenizer: 2048 tokens)
    "debug": TableConfig((5000, 5000), 4, 64, 2048, True),
    # paper heads / widths with 1/16 of the rows: the replicated baseline still fits 4 ranks here
    "paper/16": TableConfig((40400, 40400), 8, 512, 129280, True),
    # paper defaults (~0.66 B params per Engram layer); replicated x4 ranks would need ~21 GiB
    # of weights + grads alone on this 23 GiB machine: formula only (validated on paper/16)
    "paper": TableConfig((646400, 646400), 8, 512, 129280, False),
}


class CommCounter(TorchDispatchMode):
    """Bytes each rank sends to other ranks, per collective kind and phase (fwd / bwd / sync)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world, self.phase = rank, world, "fwd"
        self.bytes: dict[str, int] = {}

    def _add(self, key: str, n: int) -> None:
        self.bytes[key] = self.bytes.get(key, 0) + n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if func.namespace == "c10d" and name.startswith("alltoall_base_"):
            out, inp, _, _, in_splits = args[:5]
            row_bytes = inp[0].numel() * inp.element_size() if inp.numel() else 0
            own = in_splits[self.rank] if in_splits else inp.shape[0] // self.world
            kind = "counts" if inp.numel() == self.world and inp.dtype == torch.int64 else None
            kind = kind or (
                "ids" if inp.dtype == torch.int64 else {"fwd": "rows"}.get(self.phase, "grads")
            )
            self._add(kind, inp.numel() * inp.element_size() - own * row_bytes)
        elif func.namespace == "c10d" and name.startswith("allreduce_"):
            self._add("allreduce_tensor", sum(t.numel() * t.element_size() for t in args[0]))
        elif func.namespace == "c10d":
            self._add(f"other:{name}", 0)
        return func(*args, **(kwargs or {}))


def zipf_tokens(vocab: int, n: int, seed: int, s: float = 1.1) -> np.ndarray:
    """Token ids with Zipf(s) frequencies over a fixed random assignment of ranks to tokens."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** s
    perm = np.random.default_rng(12345).permutation(vocab)
    return perm[rng.choice(vocab, size=n, p=p / p.sum())]


def _worker(rank, world, rows: int, d: int, mode, ids_by_step, adam) -> dict:
    group = dist.group.WORLD
    ids0 = ids_by_step[0][rank]
    if mode == "replicated":
        start, stop = 0, rows
    else:
        start, stop = local_row_range(rows, rank, world)
    weight = torch.nn.Parameter(torch.zeros(stop - start, d))
    dedup = mode == "sharded_dedup"
    times, counter = [], None
    for step_ids in ids_by_step:
        ids = step_ids[rank]
        weight.grad = None  # optimizer.zero_grad(set_to_none=True)
        counter = CommCounter(rank, world)
        t0 = time.perf_counter()
        with counter:
            if mode == "replicated":
                out = F.embedding(ids, weight)
            else:
                out = sharded_embedding_lookup(ids, weight, rows, group, dedup, 1.0 / world)
            counter.phase = "bwd"
            out.sum().div(ids.numel()).backward()
            counter.phase = "sync"
            if mode == "replicated":  # DDP-style: dense full-table gradient, mean over ranks
                dist.all_reduce(weight.grad)
                weight.grad.div_(world)
        times.append(time.perf_counter() - t0)
    grad_bytes = weight.grad.numel() * weight.grad.element_size()
    param_bytes = weight.numel() * weight.element_size()
    if adam:
        opt = LazyAdam([weight], lr=1e-3)
        opt.step()
        state = opt.state[weight]
        adam_bytes = sum(
            state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq")
        )
    else:
        adam_bytes = 2 * param_bytes  # zeros_like(param) twice, as LazyAdam / Adam allocate
    return {
        "bytes": counter.bytes if counter else {},
        "lookups": ids0.numel(),
        "unique": int(torch.unique(ids0).numel()),
        "local_rows": stop - start,
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "adam_bytes": adam_bytes,
        "adam_measured": adam,
        "step_s": float(np.median(times[1:] if len(times) > 1 else times)),
    }


def _run_rank(fn, rank, world, port, args, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, fn(rank, world, *args), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, world: int, *args) -> list[dict]:
    """Fork `world` gloo ranks running fn(rank, world, *args); results by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_run_rank, args=(fn, r, world, port, args, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    for _ in range(world):
        rank, res, err = queue.get(timeout=600)
        if err:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{err}")
        results[rank] = res
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


# ----------------------------------------------------------------------------- closed form


def sharded_bytes_per_rank(lookups_sent: float, world: int, dim: int, elem: int = FP32) -> float:
    """All-to-all bytes one rank sends per step per table (uniform owners): ids out, rows back
    (it serves as many rows as it asks for, on average), row gradients back, plus the counts."""
    frac = (world - 1) / world
    return frac * lookups_sent * (ID_BYTES + 2 * dim * elem) + (world - 1) * ID_BYTES


def replicated_bytes_per_rank(table_params: float, world: int, elem: int = FP32) -> float:
    """Ring all-reduce of a dense full-table gradient: 2 (W-1)/W x table bytes per rank."""
    return 2 * (world - 1) / world * table_params * elem


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f} GiB" if x >= 2**27 else f"{x / 2**20:.2f} MiB"


def bench(
    config_names: list[str], worlds: list[int], batch: int, seq: int, steps: int
) -> list[dict]:
    rows_out = []
    for name in config_names:
        cfg = CONFIGS[name]
        hasher = cfg.hasher()
        rows, d = hasher.table_rows[1], cfg.head_dim
        for world in worlds:
            ids_by_step = []
            for step in range(steps):
                per_rank = []
                for r in range(world):
                    tok = zipf_tokens(cfg.vocab_size, batch * seq, seed=1000 * step + r)
                    h = hasher(tok.reshape(batch, seq))[:, :, 0, :]  # [B, T, H]
                    per_rank.append(torch.from_numpy(np.ascontiguousarray(h)))
                ids_by_step.append(per_rank)
            modes = ["sharded_dedup", "sharded_nodedup"] + (
                ["replicated"] if cfg.run_replicated else []
            )
            for mode in modes:
                total_table_bytes = rows * d * FP32 * (world if mode == "replicated" else 1)
                adam = 4 * total_table_bytes <= 3 * 2**30
                res = launch(_worker, world, rows, d, mode, ids_by_step, adam)
                rows_out.append(_summarise(name, world, mode, rows, d, res))
                print(_fmt(rows_out[-1]), flush=True)
            if not cfg.run_replicated:
                rows_out.append(_formula_replicated(name, world, rows, d))
                print(_fmt(rows_out[-1]), flush=True)
    return rows_out


def _summarise(name, world, mode, rows, d, res) -> dict:
    sent = [sum(r["bytes"].get(k, 0) for k in ("counts", "ids", "rows", "grads")) for r in res]
    allreduce = [r["bytes"].get("allreduce_tensor", 0) for r in res]
    wire = [s + 2 * (world - 1) / world * a for s, a in zip(sent, allreduce, strict=True)]
    mem = [r["param_bytes"] + r["grad_bytes"] + r["adam_bytes"] for r in res]
    lookups = res[0]["lookups"]
    unique = float(np.mean([r["unique"] for r in res]))
    if mode == "replicated":
        formula = replicated_bytes_per_rank(rows * d, world)
    else:
        formula = sharded_bytes_per_rank(unique if mode == "sharded_dedup" else lookups, world, d)
    return {
        "config": name,
        "world": world,
        "mode": mode,
        "rows": rows,
        "params": rows * d,
        "lookups_per_rank": lookups,
        "unique_per_rank": unique,
        "max_local_rows": max(r["local_rows"] for r in res),
        "bytes_per_rank_max": max(wire),
        "bytes_per_rank_mean": float(np.mean(wire)),
        "breakdown_rank0": res[0]["bytes"],
        "formula_bytes": formula,
        "mem_per_rank_max": max(mem),
        "adam_measured": res[0]["adam_measured"],
        "step_s": max(r["step_s"] for r in res),
        "measured": True,
    }


def _formula_replicated(name, world, rows, d) -> dict:
    return {
        "config": name,
        "world": world,
        "mode": "replicated",
        "rows": rows,
        "params": rows * d,
        "bytes_per_rank_max": replicated_bytes_per_rank(rows * d, world),
        "formula_bytes": replicated_bytes_per_rank(rows * d, world),
        "mem_per_rank_max": rows * d * 4 * FP32,
        "measured": False,
    }


def _fmt(r: dict) -> str:
    tag = "measured" if r["measured"] else "formula"
    extra = ""
    if r["measured"]:
        extra = f" step {r['step_s'] * 1e3:.0f} ms, breakdown r0 {r['breakdown_rank0']}"
    return (
        f"{r['config']:>8} W={r['world']} {r['mode']:>15} ({tag}): bytes/step/rank "
        f"{_gib(r['bytes_per_rank_max'])} (formula {_gib(r['formula_bytes'])}), "
        f"table mem/rank {_gib(r['mem_per_rank_max'])}{extra}"
    )


def markdown(results: list[dict]) -> str:
    lines = [
        "| tables | W | scheme | bytes sent / rank / step | formula | table memory / rank | "
        "lookup fwd + bwd time (slowest rank) | vs replicated (bytes, memory) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {(r["config"], r["world"]): r for r in results if r["mode"] == "replicated"}
    for r in results:
        b = base.get((r["config"], r["world"]))
        ratio = ""
        if b is not None and r["mode"] != "replicated":
            ratio = (
                f"{b['bytes_per_rank_max'] / r['bytes_per_rank_max']:.0f}x less, "
                f"{b['mem_per_rank_max'] / r['mem_per_rank_max']:.4f}x less"
            )
        how = "measured" if r["measured"] else "**formula**"
        step = f"{r['step_s'] * 1e3:.0f} ms" if r["measured"] else "-"
        lines.append(
            f"| {r['config']} ({r['params'] / 1e6:.1f} M params) | {r['world']} | {r['mode']} ({how}) | "
            f"{_gib(r['bytes_per_rank_max'])} | {_gib(r['formula_bytes'])} | "
            f"{_gib(r['mem_per_rank_max'])} | {step} | {ratio} |"
        )
    return "\n".join(lines)


def extrapolate_32b(world: int = 64, tokens_per_rank: int = 4096, layers: int = 2) -> str:
    """Closed form for Qwen2.5-32B + Engram at 2 layers with paper-size tables at `world` ranks."""
    cfg = CONFIGS["paper"]
    rows = cfg.hasher().table_rows[1]
    d, heads = cfg.head_dim, cfg.n_head_per_ngram * len(cfg.vocab_size_per_ngram)
    params = layers * rows * d
    lookups = tokens_per_rank * heads  # per layer, upper bound on what dedup sends
    sharded = layers * sharded_bytes_per_rank(lookups, world, d)
    sharded_bf16 = layers * sharded_bytes_per_rank(lookups, world, d, elem=2)
    replicated = replicated_bytes_per_rank(params, world)
    replicated_bf16 = replicated_bytes_per_rank(params, world, elem=2)
    local = layers * math.ceil(rows / world) * d
    return "\n".join(
        [
            f"Qwen2.5-32B + Engram at {layers} layers, paper tables: {params / 1e9:.3f} B table "
            f"params ({rows} rows x {d} per layer), W = {world}, {tokens_per_rank} tokens per rank "
            f"per step ({heads} lookups per token per layer, no dedup = upper bound)",
            "",
            "| quantity per rank per step | sharded (this repo) | replicated (DDP) | ratio |",
            "| --- | --- | --- | --- |",
            f"| bytes sent, fp32 rows / grads | {_gib(sharded)} | {_gib(replicated)} (fp32 grad ring all-reduce) "
            f"| {replicated / sharded:.0f}x |",
            f"| bytes sent, if rows / grads travelled as bf16 (not implemented) | {_gib(sharded_bf16)} | "
            f"{_gib(replicated_bf16)} (bf16 grad ring all-reduce) "
            f"| {replicated_bf16 / sharded_bf16:.0f}x |",
            f"| table memory at 14 B/param (bf16 weight + fp32 master + 2 fp32 moments) | "
            f"{_gib(local * 14)} | {_gib(params * 14)} | {params / local:.2f}x |",
            f"| table memory at 16 B/param (this repo: fp32 weight + fp32 grad + 2 fp32 moments) | "
            f"{_gib(local * 16)} | {_gib(params * 16)} | {params / local:.2f}x |",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    results = bench(args.configs, args.worlds, args.batch, args.seq, args.steps)
    print()
    print(f"B x T = {args.batch} x {args.seq} tokens per rank per step, Engram layer 1, gloo")
    print(markdown(results))
    print()
    print(extrapolate_32b())


if __name__ == "__main__":
    main()
