"""How Engram table rows are reused across steps on real text: the numbers the NVMe tier's host
cache, prefetch distance and page layout are sized from (docs/host_tables.md).

    python scripts/prepare_data.py --input CORPUS --out DATA          # token shards
    python benchmarks/bench_table_reuse.py --data DATA \\
        --configs train_configs/32b_npu.toml,train_configs/32b_npu_v4_tables.toml --ranks 64

Per config: a step is ranks x local_batch_size x grad_accum_steps sequences of seq_len tokens,
read in order from the shards (no shuffling: consecutive windows of the corpus), hashed with the
config's [engram] settings (NgramHasher: its layers, orders, heads and vocab_size_per_ngram) and
the tokenizer the shards were prepared with. Each Engram layer is one table, row-sharded over
`--ranks` owners by the tables' torch.chunk split. Reported, over the layers' tables:

- unique rows per step per rank: the rows an owner serves in one step (mean and max over
  ranks): what the NVMe tier must have in host memory for a step;
- reuse: the share of a step's unique rows that were also touched in the previous 1 / 2 / k
  steps (how much a cache of the last steps' rows saves);
- hot set: the fewest rows covering 50 / 90 / 99% of all lookups over the run, as a share of
  the table's rows;
- Zipf slope: the least-squares slope of log(lookups) against log(rank) of the rows, ranks 10 to
  10^4 (about -1 for Zipfian text).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def step_rows(ids: np.ndarray, layer: int) -> np.ndarray:
    """The rows of table `layer` one step looks up: [B, T, L, H] ids -> flat int64."""
    return ids[:, :, layer, :].reshape(-1)


def owner_counts(unique_rows: np.ndarray, rows: int, ranks: int) -> np.ndarray:
    """Unique rows per owner rank (torch.chunk split: ceil(rows / ranks) a rank)."""
    per = -(-rows // ranks)
    return np.bincount(unique_rows // per, minlength=ranks)


def hot_share(counts: np.ndarray, shares=(0.5, 0.9, 0.99)) -> list[int]:
    """The fewest rows covering each share of the lookups."""
    ordered = np.sort(counts)[::-1]
    cum = np.cumsum(ordered) / ordered.sum()
    return [int(np.searchsorted(cum, s) + 1) for s in shares]


def zipf_slope(counts: np.ndarray, lo: int = 10, hi: int = 10_000) -> float:
    ordered = np.sort(counts)[::-1][lo - 1 : hi]
    ranks = np.arange(lo, lo + ordered.size)
    return float(np.polyfit(np.log(ranks), np.log(ordered), 1)[0])


def measure(cfg, shards, hasher, ranks: int, max_steps: int, ks: tuple[int, ...]) -> dict:
    t = cfg.training
    seqs = ranks * t.local_batch_size * t.grad_accum_steps
    tokens_per_step = seqs * t.seq_len
    steps = min(max_steps, shards.num_tokens // tokens_per_step)
    if steps < 2:
        raise SystemExit(
            f"{cfg.job.config_file}: the corpus has {shards.num_tokens} tokens, fewer than two "
            f"steps of {tokens_per_step}: use fewer --ranks or a larger corpus"
        )
    layers = list(hasher.layer_ids)
    history: dict[int, list[np.ndarray]] = {i: [] for i in range(len(layers))}
    per_rank, reuse, lookups = [], {k: [] for k in ks}, {i: [] for i in range(len(layers))}
    for s in range(steps):
        tokens, _ = shards.read(s * tokens_per_step, (s + 1) * tokens_per_step)
        ids = hasher(np.asarray(tokens, dtype=np.int64).reshape(seqs, t.seq_len))
        for i, layer in enumerate(layers):
            rows = hasher.table_rows[layer]
            flat = step_rows(ids, i)
            uniq, cnt = np.unique(flat, return_counts=True)
            lookups[i].append((uniq, cnt))
            per_rank.append(owner_counts(uniq, rows, ranks))
            for k in ks:
                if len(history[i]) >= k:
                    seen = np.unique(np.concatenate(history[i][-k:]))
                    reuse[k].append(np.isin(uniq, seen, assume_unique=True).mean())
            history[i].append(uniq)
            history[i] = history[i][-max(ks) :]
    hot, slopes, table_rows = [], [], []
    for i, layer in enumerate(layers):
        uniq = np.concatenate([u for u, _ in lookups[i]])
        cnt = np.concatenate([c for _, c in lookups[i]])
        order = np.argsort(uniq, kind="stable")
        uniq, cnt = uniq[order], cnt[order]
        starts = np.flatnonzero(np.r_[True, uniq[1:] != uniq[:-1]])
        counts = np.add.reduceat(cnt, starts)
        hot.append(hot_share(counts))
        slopes.append(zipf_slope(counts))
        table_rows.append(hasher.table_rows[layer])
    pr = np.stack(per_rank)
    return {
        "steps": steps,
        "tokens_per_step": tokens_per_step,
        "lookups_per_step": tokens_per_step * ids.shape[3],
        "table_rows": table_rows,
        "unique_mean": float(pr.mean()),
        "unique_max": int(pr.max()),
        "rank_rows": -(-max(table_rows) // ranks),
        "reuse": {k: float(np.mean(v)) if v else float("nan") for k, v in reuse.items()},
        "hot": [[h[j] / r for h, r in zip(hot, table_rows, strict=True)] for j in range(3)],
        "zipf": float(np.mean(slopes)),
    }


def main() -> None:
    from engram.config import load_config
    from engram.data.shards import TokenShards
    from engram.data.tokenizer import load_tokenizer
    from engram.hashing.ngram import NgramHasher

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", required=True, help="token shards (scripts/prepare_data.py --out)")
    ap.add_argument("--configs", default="train_configs/32b_npu.toml")
    ap.add_argument("--ranks", type=int, default=64, help="ranks the tables shard over")
    ap.add_argument("--tokenizer", default=None, help="the shards' tokenizer (default: debug)")
    ap.add_argument("--max_steps", type=int, default=12)
    ap.add_argument("--k", type=int, default=4, help="the longest reuse window, in steps")
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer or "")
    ks = tuple(sorted({1, 2, args.k}))
    print(
        "| config | ranks | steps x tokens | table rows | unique rows / step / rank (mean, max; "
        "share of a rank's rows) | "
        + " | ".join(f"reused from last {k}" for k in ks)
        + " | hot set 50 / 90 / 99% of lookups (share of rows) | Zipf slope |"
    )
    print("| --- " * (7 + len(ks)) + "|")
    for path in args.configs.split(","):
        cfg = load_config(["--job.config_file", path])
        shards = TokenShards(args.data, None, tok.vocab_size)
        hasher = NgramHasher.from_config(cfg.engram, tok, tok.vocab_size)
        r = measure(cfg, shards, hasher, args.ranks, args.max_steps, ks)
        hot = " / ".join(
            "{:.2g}%".format(100 * max(r["hot"][j])) for j in range(3)
        )  # the largest layer share
        print(
            f"| {Path(path).name} | {args.ranks} | {r['steps']} x {r['tokens_per_step']:,} | "
            f"{', '.join(f'{n:,}' for n in r['table_rows'])} | "
            f"{r['unique_mean']:,.0f}, {r['unique_max']:,} "
            f"({100 * r['unique_max'] / r['rank_rows']:.2g}%) | "
            + " | ".join(f"{100 * r['reuse'][k]:.1f}%" for k in ks)
            + f" | {hot} | {r['zipf']:.2f} |"
        )


if __name__ == "__main__":
    main()
