"""engram-peft 1.2.7 side of benchmarks/bench_table_step.py; runs in ITS OWN virtual environment.

    <epeft-venv>/bin/python benchmarks/engram_peft_worker.py --data DIR --config full_engram

Imports nothing from this repository. Protocol on stdin/stdout: prints "ready", then for each
"step" line runs one training step and prints its seconds; "quit" exits.

Fairness choices (each one favours engram-peft): its hash ids are precomputed before timing and
its model-level hook that re-hashes input ids on the host every forward is removed (the layer
hooks read the precomputed ids); its Trainer's global gradient clipping (max_norm 1) is the
same computation as ours.
"""

from __future__ import annotations

import argparse
import sys
import time
import typing

typing.override = lambda f: f  # engram-peft imports typing.override (Python 3.12+)

import numpy as np  # noqa: E402
import torch  # noqa: E402

# LoRA of the lora_engram configuration (the same on our side: benchmarks/bench_table_step.py).
LORA_RANK, LORA_ALPHA = 8, 16
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAIN_MODES = {
    "full_engram": "full_finetune",
    "engram_only": "engram_only",
    "lora_engram": "preserve_trainable",  # keeps the LoRA adapters trainable
}


def build(config: str, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        pad_token_id=0,
        rope_theta=500000.0,
    )
    model = LlamaForCausalLM(cfg)
    if config == "lora_engram":  # its documented stacking: PEFT LoRA first, then Engram on top
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS)
        model = get_peft_model(model, lora)
    if config == "plain":
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4), None
    from engram_peft import get_engram_model

    em = get_engram_model(
        model,
        dict(
            engram_vocab_size_per_ngram=[200000, 200000],  # split over its 4 heads: 50000 each
            ngram_sizes=[2, 3],
            n_head_per_ngram=4,
            embedding_dim=256,
            enable_tokenizer_compression=False,  # ids below are already what both sides hash
            compressed_vocab_size=vocab,
            target_layers=[1, 2],
            hc_mult=1,
            pad_id=0,
            seed=0,
        ),
        train_mode=TRAIN_MODES[config],
    )
    em._hook_handles[0].remove()  # the re-hashing model hook; precomputed ids are used instead
    return em, em.create_optimizer(base_learning_rate=3e-4), em.hash_mapping


def clip(model: torch.nn.Module, max_norm: float) -> None:
    """engram-peft's EngramTrainer._clip_grad_norm (global norm) without the Trainer."""
    from engram_peft.utils.general import compute_grad_norm

    total = compute_grad_norm(model.parameters())
    if total is None:
        return
    coef = torch.tensor(max_norm) / (total + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad
                (g.coalesce().values() if g.is_sparse else g).detach().mul_(coef)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--config", choices=["plain", *TRAIN_MODES], required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = np.load(f"{args.data}/tokens.npy")  # [N, B, T + 1]
    vocab = int(open(f"{args.data}/vocab_size").read())
    model, opt, hashing = build(args.config, vocab)
    model.train()
    batches = []
    for seq in tokens:
        ids = torch.from_numpy(seq[:, :-1]).contiguous()
        hashed = None
        if hashing is not None:  # [B, T, layers, heads], the layout its layer hooks slice
            h = hashing.hash(ids.numpy())
            hashed = torch.from_numpy(np.stack([h[1], h[2]], axis=2))
        batches.append((ids, torch.from_numpy(seq[:, :-1]).contiguous(), hashed))
    print("ready", flush=True)
    i = 0
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        ids, labels, hashed = batches[i % len(batches)]
        i += 1
        t0 = time.perf_counter()
        if hashed is not None:
            model._current_hash_indices = hashed
            loss = model.base_model(input_ids=ids, labels=labels).loss
        else:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        clip(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        print(f"{dt:.6f} {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
