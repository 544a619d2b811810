"""Knowledge injection: does fine-tuning with Engram teach a pretrained model facts that LoRA does not?

    PYTHONPATH=. python benchmarks/bench_knowledge_injection.py \
        [--entities 64 --pretrain-steps 200 --steps 150 --seeds 0,1,2 --threads 2]

1. Pretrain the debug model (train_configs/debug_model.toml's backbone, no Engram) on documents
   about the "pretrain" part of the synthetic facts (data.synthetic_part = "pretrain": half of
   the entities), then export it as a Hugging Face folder (the backbone every method loads).
2. Fine-tune it on question / answer conversations about the OTHER part ("finetune": entities it
   never saw) with each method, at equal steps, batch, data order and learning-rate schedule:
   - lora: LoRA r 16 on every projection, no Engram (training.mode = "lora", engram off);
   - engram: Engram only (one Engram layer at layer 1, identity init, training.mode =
     "engram_only": the backbone is frozen);
   - lora+engram: both (training.mode = "lora" with Engram);
   - full: every backbone weight trains, no Engram (training.mode = "full").
   Trainable parameters are counted from the built model (requires_grad), Engram tables included.
3. Measure on each fine-tuned model (engram/inference/qa.py: greedy answers through the chat
   template, exact match after case-folding, punctuation removal and whitespace collapse):
   - held-out EM: every fact of the fine-tune part asked ONCE in a phrasing the training set never
     uses (synthetic_chat's "val" split): recall of the injected facts beyond the words they were
     taught with;
   - train EM: the same facts asked in the training phrasings (the first --train-questions of
     them): memorisation of what was taught;
   - pretrain-part EM: facts of the PRETRAIN part (seen only as documents in step 1, never as
     questions), asked in the held-out phrasing (the first --train-questions): whether the
     fine-tuned model answers from its pretrained knowledge, and whether the fine-tune kept it;
   - held-out loss: the token-mean loss on the answer tokens of the held-out conversations (every
     row of the "val" split, the training loop's evaluation).
3 seeds: job.seed changes the LoRA init, the data order and the Engram hash seed stays fixed.
Runs in one process on CPU (training through recipes/train.py's `train`, as
benchmarks/engram_vs_baseline.py); sizes are kept small so that the whole benchmark takes minutes
on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/ is not an installed package
from engram.config import config_from_dict  # noqa: E402
from engram.data.chat_dataset import build_chat_samples  # noqa: E402
from engram.data.tokenizer import load_tokenizer  # noqa: E402
from engram.inference.export_run import export_checkpoint  # noqa: E402
from engram.inference.qa import Asker, exact_match, questions  # noqa: E402
from engram.models.builder import build_hasher  # noqa: E402
from recipes.train import train  # noqa: E402

ENGRAM = {
    "layer_ids": [1], "max_ngram": 3, "n_head_per_ngram": 4, "vocab_size_per_ngram": [5000, 5000],
    "n_embed_per_ngram": 512, "kernel_size": 4, "init": "identity", "respect_doc_boundaries": True,
}  # fmt: skip
METHODS = {  # name -> (training.mode, Engram on)
    "lora": ("lora", False),
    "engram": ("engram_only", True),
    "lora+engram": ("lora", True),
    "full": ("full", False),
}


def base(folder: str, name: str, seed: int, args: argparse.Namespace) -> dict:
    return {
        "job": {"dump_folder": folder, "run_name": name, "device": "cpu", "seed": seed},
        "model": {"name": "llama3", "flavor": "debug"},
        "training": {"seq_len": 128, "local_batch_size": 8},
        "data": {"synthetic_num_entities": args.entities, "num_workers": 0},
        "optimizer": {"lr": args.lr, "weight_decay": 0.0},
        "lr_scheduler": {"warmup_steps": 5, "decay_type": "cosine", "min_lr_ratio": 0.1},
        "metrics": {"log_freq": 1_000_000, "enable_tensorboard": False},
    }


def pretrain(folder: str, args: argparse.Namespace) -> str:
    """The backbone: the debug model trained on documents about the pretrain part, exported."""
    raw = base(folder, "pretrain", 0, args)
    raw["engram"] = {"enabled": False}
    raw["training"]["steps"] = args.pretrain_steps
    raw["data"].update(dataset="synthetic_facts", synthetic_part="pretrain")
    raw["checkpoint"] = {"enable": True, "interval": args.pretrain_steps}
    cfg = config_from_dict(raw)
    result = train(cfg)
    out = str(Path(folder) / "pretrained_hf")
    export_checkpoint(cfg, out)
    print(f"pretrained {args.pretrain_steps} steps: last train loss {result.losses[-1]:.3f}")
    return out


def finetune_config(folder: str, backbone: str, method: str, seed: int, args) -> dict:
    mode, engram = METHODS[method]
    raw = base(folder, f"{method}_seed{seed}", seed, args)
    raw["model"].update(hf_checkpoint=backbone, attn_mask_type="block_causal")
    raw["engram"] = {**ENGRAM, "enabled": True} if engram else {"enabled": False}
    raw["training"].update(mode=mode, steps=args.steps)
    raw["data"].update(dataset="synthetic_chat", synthetic_part="finetune")
    if mode == "lora":
        raw["lora"] = {"rank": 16, "alpha": 32.0}
    return raw


def run(folder: str, backbone: str, method: str, seed: int, args) -> dict:
    raw = finetune_config(folder, backbone, method, seed, args)
    cfg = config_from_dict(raw)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    rows = build_chat_samples(cfg, tokenizer, "val").rows
    cfg.data.eval_batches = math.ceil(rows / cfg.training.local_batch_size)  # the whole val split
    start = time.perf_counter()
    result = train(cfg)
    model = result.model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    hasher = build_hasher(cfg, tokenizer)
    asker = Asker(cfg, tokenizer)
    model.eval()
    n, new = args.train_questions, args.max_new_tokens
    held = exact_match(model, hasher, asker, questions(cfg, tokenizer, "val"), new)
    seen = exact_match(model, hasher, asker, questions(cfg, tokenizer, "train", n), new)
    pre = config_from_dict({**raw, "data": {**raw["data"], "synthetic_part": "pretrain"}})
    known = exact_match(model, hasher, asker, questions(pre, tokenizer, "val", n), new)
    return {
        "method": method, "seed": seed, "trainable": trainable,
        "heldout_em": held.score, "train_em": seen.score, "pretrain_part_em": known.score,
        "heldout_loss": result.eval_losses[args.steps], "train_loss": result.losses[-1],
        "questions": [held.total, seen.total, known.total], "seconds": time.perf_counter() - start,
    }  # fmt: skip


def _mean(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| method | trainable params | held-out EM | train EM | pretrain-part EM | held-out loss |",
        "| --- | ---: | --- | --- | --- | --- |",
    ]
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        cells = [
            _mean([r[k] for r in mine])
            for k in ("heldout_em", "train_em", "pretrain_part_em", "heldout_loss")
        ]
        lines.append(f"| {method} | {mine[0]['trainable']:,} | " + " | ".join(cells) + " |")
    lines += ["", "| method | seed | held-out EM | train EM | pretrain-part EM | held-out loss |"]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['seed']} | {r['heldout_em']:.3f} | {r['train_em']:.3f} | "
            f"{r['pretrain_part_em']:.3f} | {r['heldout_loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entities", type=int, default=64, help="fact base size (half fine-tuned)")
    ap.add_argument("--pretrain-steps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=150, help="fine-tuning steps, every method")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--train-questions", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        backbone = pretrain(folder, args)
        for seed in (int(s) for s in args.seeds.split(",")):
            for method in args.methods.split(","):
                rows.append(run(folder, backbone, method, seed, args))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(
        f"\ndebug model: pretrain {args.pretrain_steps} steps on the pretrain part of "
        f"{args.entities} entities; fine-tune {args.steps} steps (batch 8 x 128, lr {args.lr}) on "
        f"QA about the other part; {time.perf_counter() - start:.0f} s in all\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
