"""Training step time per Engram table optimizer, side by side with engram-peft 1.2.7.

    python benchmarks/bench_table_step.py --epeft-python $EPEFT_VENV/bin/python \
        [--steps 20 --warmup 5 --configs plain,full_engram,engram_only,lora_engram --worlds 1,2,4]

lora_engram: LoRA r 8, alpha 16 on all seven projections + Engram; engram-peft stacks
PEFT's LoRA (get_peft_model) and then Engram with train_mode "preserve_trainable", ours runs
training.mode = "lora".

Workload: Llama shape dim 256, 4 layers, 4 heads, 2 KV heads, SwiGLU 768, untied, one
byte-level BPE of 8,192 tokens trained here and shared by both; Engram at layers 1 and 2, orders
2-3, 4 heads per order, 32 wide per head (n_embed_per_ngram 128; engram-peft embedding_dim 256),
vocab_size_per_ngram [50000, 50000] (engram-peft [200000, 200000] split over its heads: the same
primes, 25.6 M table parameters); batch 8 x 256 tokens of synthetic fact documents, fp32, 2
threads, hash ids precomputed for both, identity init, global clipping at 1.0.

Each implementation runs in its own worker process (engram-peft in its own virtual environment:
benchmarks/engram_peft_worker.py); the driver tells the workers of one configuration to time one
step each, in turn, and reports medians of `--steps` steps after `--warmup`. Ratios come from
these interleaved steps, so machine load affects both sides alike.

Then our sharded path (FSDP + all-to-all tables) at `--worlds` ranks, the worlds interleaved step
by step per table optimizer (1 thread each, local batch
8 x 256 per rank): step time and time per token per table optimizer.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engram.config.table_optimizers import TABLE_OPTIMIZERS  # noqa: E402

VOCAB = 8192
BATCH, SEQ = 8, 256
MODES = {"engram_only": "engram_only", "lora_engram": "lora"}  # configuration -> training.mode


# ------------------------------------------------------------------------------- data


def prepare_data(folder: Path, n_batches: int) -> None:
    """An 8,192-token byte-level BPE and token batches [N, B, T + 1] of synthetic fact documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from engram.data.synthetic import SyntheticFacts
    from scripts.make_debug_tokenizer import ENGLISH, SPECIAL_TOKENS

    facts = SyntheticFacts(fact_seed=0, num_entities=2048, stream_seed=0, split="train")
    docs = [facts[i] for i in range(6000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs + ENGLISH.splitlines() * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    stream: list[int] = []
    for d in docs[::-1]:  # other documents first than the ones the BPE saw most recently
        stream += tok.encode(d).ids + [tok.token_to_id("<|eos|>")]
        if len(stream) > n_batches * BATCH * (SEQ + 1):
            break
    arr = np.array(stream[: n_batches * BATCH * (SEQ + 1)], dtype=np.int64)
    np.save(folder / "tokens.npy", arr.reshape(n_batches, BATCH, SEQ + 1))
    (folder / "vocab_size").write_text(str(VOCAB))


# ------------------------------------------------------------------------------- our worker


def _config(data: str, config: str, table_optimizer: str, world: int) -> dict:
    engram = config != "plain"
    return {
        "job": {"dump_folder": tempfile.gettempdir(), "run_name": "bench", "device": "cpu"},
        "model": {
            "name": "llama3",
            "flavor": "debug",
            "tokenizer_path": f"{data}/tokenizer.json",
            "vocab_size": VOCAB,
        },
        "engram": {
            "enabled": engram,
            "layer_ids": [1, 2],
            "max_ngram": 3,
            "n_head_per_ngram": 4,
            "n_embed_per_ngram": 128,
            "vocab_size_per_ngram": [50000, 50000],
            "init": "identity",
        },
        "training": {
            "mode": MODES.get(config, "full"),
            "seq_len": SEQ,
            "local_batch_size": BATCH,
            "max_norm": 1.0,
        },
        "optimizer": {"table_optimizer": table_optimizer},
        # engram_peft_worker.py's LORA_RANK / LORA_ALPHA; all seven projections (the default)
        **({"lora": {"rank": 8, "alpha": 16.0}} if config == "lora_engram" else {}),
        "parallelism": {"dp_shard": world},
        "metrics": {"enable_tensorboard": False},
    }


def our_worker(data: str, config: str, table_optimizer: str, threads: int) -> None:
    import torch
    import torch.nn.functional as F

    from engram.config import config_from_dict
    from engram.data.tokenizer import load_tokenizer
    from engram.models.builder import build_from_config
    from engram.optim.builder import apply_training_mode, build_optimizers, clip_grad_norm_
    from engram.runtime.distributed import init_distributed
    from parallelisms.parallel_dims import parallel_dims_from_config
    from parallelisms.parallelize import parallelize_model

    torch.set_num_threads(threads)
    rank, _, world = init_distributed("cpu")
    cfg = config_from_dict(_config(data, config, table_optimizer, world))
    dims = parallel_dims_from_config(cfg, world)
    dims.build_mesh("cpu")
    model, hasher = build_from_config(cfg, load_tokenizer(cfg.model.tokenizer_path))
    parallelize_model(model, cfg, dims)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    apply_training_mode(model, cfg.training.mode)
    optimizers = build_optimizers(model, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    tokens = np.load(f"{data}/tokens.npy")
    batches = []
    for i, seq in enumerate(tokens):
        if i % world != rank:  # each rank its own batches of the same stream
            continue
        ids = torch.from_numpy(seq[:, :-1]).contiguous()
        labels = torch.from_numpy(seq[:, 1:]).contiguous()
        hash_ids = None if hasher is None else torch.from_numpy(hasher(seq[:, :-1]))
        batches.append((ids, labels, hash_ids))
    print("ready", flush=True)
    i = 0
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        ids, labels, hash_ids = batches[i % len(batches)]
        i += 1
        t0 = time.perf_counter()
        logits = model(ids, hash_ids=hash_ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        clip_grad_norm_(trainable, cfg.training.max_norm)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        print(f"{dt:.6f} {loss.item():.4f}", flush=True)
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------- driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One implementation: one process, or `world` processes that step together."""

    def __init__(self, name: str, cmds: list[list[str]], envs: list[dict]) -> None:
        self.name = name
        self.procs = [
            subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=e)
            for c, e in zip(cmds, envs, strict=True)
        ]
        self.times: list[float] = []
        self.losses: list[float] = []
        self.log = ""

    def wait_ready(self) -> None:
        for p in self.procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"{self.name}: worker failed to start (got {line!r})")

    def step(self, record: bool) -> None:
        for p in self.procs:
            p.stdin.write("step\n")
            p.stdin.flush()
        replies = [p.stdout.readline().split() for p in self.procs]
        if any(not r for r in replies):
            raise RuntimeError(f"{self.name}: worker died")
        if record:
            self.times.append(max(float(r[0]) for r in replies))  # the step ends with the slowest
            self.losses.append(float(replies[0][1]))
            if self.log:  # every step as it comes: a run cut short still has its data
                with open(self.log, "a") as f:
                    f.write(f"{self.name}\t{self.times[-1]:.6f}\t{self.losses[-1]:.4f}\n")

    def close(self) -> None:
        for p in self.procs:
            p.stdin.write("quit\n")
            p.stdin.flush()
        for p in self.procs:
            p.wait(timeout=120)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def _ours(data: str, config: str, opt: str, threads: int, world: int = 1, port: int = 0) -> Worker:
    base = [sys.executable, __file__, "--worker", config, "--table-optimizer", opt]
    base += ["--data", data, "--threads", str(threads)]
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONPATH": str(ROOT)}
    if world == 1:
        return Worker(f"ours {opt}", [base], [env])
    envs = [
        {
            **env,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for r in range(world)
    ]
    return Worker(f"ours {opt} x{world}", [base] * world, envs)


def _interleave(workers: list[Worker], warmup: int, steps: int) -> None:
    for w in workers:
        w.wait_ready()
    for i in range(warmup + steps):
        for w in workers:  # one step each, in turn
            w.step(record=i >= warmup)
    for w in workers:
        w.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    # Required of the driver only: the workers this script starts run without it.
    ap.add_argument("--epeft-python", default="", help="python of a venv with engram-peft==1.2.7")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worlds", default="1,2,4", help="our sharded path; empty: skip")
    ap.add_argument(
        "--configs", default="plain,full_engram,engram_only,lora_engram", help="empty: skip"
    )
    ap.add_argument("--table-optimizers", default=",".join(TABLE_OPTIMIZERS))
    ap.add_argument("--sharded-optimizers", default=",".join(TABLE_OPTIMIZERS))
    ap.add_argument("--step-log", default="", help="append every timed step to this file")
    ap.add_argument("--worker", default="")
    ap.add_argument("--table-optimizer", default="adam")
    ap.add_argument("--data", default="")
    args = ap.parse_args()
    if args.worker:
        our_worker(args.data, args.worker, args.table_optimizer, args.threads)
        return
    if not args.epeft_python:
        ap.error("--epeft-python is required: the python of a venv with engram-peft==1.2.7")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        prepare_data(data, n_batches=16)
        peft = [args.epeft_python, str(ROOT / "benchmarks" / "engram_peft_worker.py")]
        print(
            "| configuration | ours | ours median (s) | engram-peft median (s) | ours / engram-peft |"
        )
        print("| --- | --- | --- | --- | --- |", flush=True)
        for config in [c for c in args.configs.split(",") if c]:
            ref = Worker(
                "engram-peft",
                [peft + ["--data", str(data), "--config", config, "--threads", str(args.threads)]],
                [{**os.environ}],
            )
            opts = ["adam"] if config == "plain" else args.table_optimizers.split(",")
            ours = [_ours(str(data), config, o, args.threads) for o in opts]
            for w in (ref, *ours):
                w.log = args.step_log
            _interleave([ref, *ours], args.warmup, args.steps)
            for w in ours:
                label = "AdamW (no tables)" if config == "plain" else w.name.split()[-1]
                print(
                    f"| {config} | {label} | {w.median:.4f} | {ref.median:.4f} | "
                    f"{w.median / ref.median:.3f} |",
                    flush=True,
                )
        worlds = [int(w) for w in args.worlds.split(",") if w]
        if not worlds:
            return
        print("\n| configuration | table optimizer | ranks | step median (s) | ms per 1k tokens |")
        print("| --- | --- | --- | --- | --- |", flush=True)
        for opt in args.sharded_optimizers.split(","):  # worlds interleaved step by step
            ours = [
                _ours(str(data), "full_engram", opt, args.threads if w == 1 else 1, w, free_port())
                for w in worlds
            ]
            _interleave(ours, args.warmup, args.steps)
            for world, w in zip(worlds, ours, strict=True):
                per_k = 1000 * w.median / (world * BATCH * SEQ) * 1000
                print(
                    f"| full_engram | {opt} | {world} | {w.median:.4f} | {per_k:.2f} |", flush=True
                )


if __name__ == "__main__":
    main()
