"""Bytes of the Engram table all-to-all per rank and step: TP sequence-sharded lookups vs
data-parallel only, fp32 vs bf16 payload (`parallelism.engram_a2a_dtype`).

    python benchmarks/bench_table_a2a.py

4 real gloo ranks, one Engram layer's table at the [engram] default sizes with 4 heads per n-gram
order x 32 wide (5.17 M rows), Zipf text-like token ids hashed by the real hasher, global batch
8 x 256, dedup on.
Layouts at the same global batch (8 sequences):
  dp4       every rank looks up its own 2 sequences x 256 tokens (the tables over 4 ranks);
  dp2 x tp2 each data replica's 4 sequences are split along the sequence: each TP rank looks up
            its own 128 tokens of them (what the sequence-sharded Engram block does);
  dp2 x tp2, gathered  the alternative this repo did not choose: both TP ranks look up all 256
            tokens of the replica (duplicated lookups).
Bytes are counted per rank at the c10d dispatcher (what leaves the rank), forward rows + backward
row gradients + ids + counts, mean over ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_engram_tables import CommCounter, launch, zipf_tokens  # noqa: E402

from engram.config import Engram  # noqa: E402
from engram.data.tokenizer import load_tokenizer  # noqa: E402
from engram.hashing.ngram import NgramHasher  # noqa: E402
from parallelisms.engram_tables import local_row_range, sharded_embedding_lookup  # noqa: E402

SEQ, GLOBAL_B, WORLD = 256, 8, 4


def _ids(hasher: NgramHasher) -> np.ndarray:
    toks = zipf_tokens(hasher.num_ids, GLOBAL_B * SEQ, seed=0).reshape(GLOBAL_B, SEQ)
    return hasher(toks)[:, :, 0]  # [B, T, heads] of the first Engram layer, offsets included


def _worker(rank, world, layout, wire, ids_all, rows, dim) -> dict:
    tp = 1 if layout == "dp4" else 2
    dp_rank, tp_rank = divmod(rank, tp)
    per_replica = GLOBAL_B // (world // tp)
    ids = ids_all[dp_rank * per_replica : (dp_rank + 1) * per_replica]
    if layout == "dp2xtp2":  # sequence-sharded: this TP rank's tokens only
        ids = ids[:, tp_rank * SEQ // tp : (tp_rank + 1) * SEQ // tp]
    start, stop = local_row_range(rows, rank, world)
    weight = torch.zeros(stop - start, dim, requires_grad=True)
    counter = CommCounter(rank, world)
    with counter:
        out = sharded_embedding_lookup(
            torch.from_numpy(np.ascontiguousarray(ids)), weight, rows, dist.group.WORLD,
            dedup=True, grad_scale=1.0, wire_dtype=wire,
        )  # fmt: skip
        counter.phase = "bwd"
        out.sum().backward()
    return counter.bytes


def main() -> None:
    torch.manual_seed(0)
    cfg = Engram(layer_ids=[1], n_head_per_ngram=4, n_embed_per_ngram=128)
    tok = load_tokenizer("")
    hasher = NgramHasher.from_config(cfg, tok, tok.vocab_size)
    rows, dim = hasher.table_rows[1], cfg.n_embed_per_ngram // cfg.n_head_per_ngram
    ids_all = _ids(hasher)
    print(f"table: {rows:,} rows x {dim}; global batch {GLOBAL_B} x {SEQ}; {WORLD} ranks\n")
    print("| layout | payload | rows (fwd) | row grads (bwd) | ids + counts | total per rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layout in ("dp4", "dp2xtp2", "dp2xtp2_gathered"):
        for wire in (torch.float32, torch.bfloat16):
            res = launch(_worker, WORLD, layout, wire, ids_all, rows, dim)
            mean = {
                k: np.mean([r.get(k, 0) for r in res]) for k in ("rows", "grads", "ids", "counts")
            }
            total = sum(mean.values())
            name = str(wire).replace("torch.", "")
            print(
                f"| {layout} | {name} | {mean['rows'] / 1024:.1f} KiB | {mean['grads'] / 1024:.1f} KiB"
                f" | {(mean['ids'] + mean['counts']) / 1024:.1f} KiB | {total / 1024:.1f} KiB |"
            )


if __name__ == "__main__":
    main()
