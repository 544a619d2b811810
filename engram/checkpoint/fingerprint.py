"""What a checkpoint's weights mean: everything that changes how a stored number is used.

Computed from the config, the tokenizer, the hasher and (trainable_only) the frozen HF folder's
content digest, never from a model part's layers, so every pipeline stage and every layout
computes the same fingerprint. A resume compares it key by key (engram/checkpoint/); harmless settings (lr, steps, logging, eval, num_workers,
parallel layout) are deliberately absent. Two parts exist only where they apply: `lora` (rank,
alpha, target modules) in lora mode, and `frozen_base` (the identity of the backbone a
checkpoint.trainable_only checkpoint does not hold: base_identity.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from engram.checkpoint.base_identity import frozen_base
from engram.config import JobConfig
from engram.models.builder import model_args_for


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's full JSON (vocabulary, merges, normaliser, special tokens)."""
    return hashlib.sha256(tokenizer.hf.to_str().encode()).hexdigest()[:16]


def config_fingerprint(cfg: JobConfig, tokenizer: Any, hasher: Any | None) -> dict[str, Any]:
    """The checkpoint fingerprint of this job (JSON-serialisable): what training, generation
    and export compare (engram/checkpoint/)."""
    args = model_args_for(cfg.model, tokenizer.vocab_size)
    shape = {k: v for k, v in dataclasses.asdict(args).items() if k != "max_seq_len"}
    layers = sorted(hasher.layer_ids) if hasher is not None else []
    fp: dict[str, Any] = {
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
        "vocab_size": args.vocab_size,
        "engram_layers": layers,
        "engram_table_rows": [hasher.table_rows[i] for i in layers] if hasher else [],
        "engram_head_dim": cfg.engram.head_dim if hasher else 0,
        "model_shape": shape,
        "tokenizer": {"sha256": tokenizer_fingerprint(tokenizer), "size": tokenizer.vocab_size},
        "training_mode": cfg.training.mode,
        "table_optimizer": cfg.optimizer.table_optimizer,
    }
    if cfg.training.mode == "lora":
        # What the adapters mean: their shapes (rank), where they sit and their scale. Not
        # dropout (training-time noise only: eval, generation and export are the same function)
        # nor init_a (used at step 0 only). Absent in other modes, so their fingerprint is as
        # before and their checkpoints still resume.
        fp["lora"] = {
            "rank": cfg.lora.rank,
            "alpha": cfg.lora.alpha,
            "target_modules": sorted(cfg.lora.target_modules),
        }
    if cfg.checkpoint.trainable_only:
        # The frozen backbone is not in such a checkpoint: record which one it trained on.
        fp["frozen_base"] = frozen_base(cfg.model.hf_checkpoint, cfg.job.seed)
    if hasher is not None:
        e = cfg.engram
        fp["engram"] = {
            "max_ngram": e.max_ngram,
            "n_head_per_ngram": e.n_head_per_ngram,
            "n_embed_per_ngram": e.n_embed_per_ngram,
            "table_primes": {str(i): [int(p) for p in hasher.table_sizes[i]] for i in layers},
            "hash_seed": e.seed,
            "pad_id": hasher.pad_id,
            "compress_tokenizer": e.compress_tokenizer,
            "compressed_vocab": hasher.compressed_vocab,
            "kernel_size": e.kernel_size,
            "hc_mult": e.hc_mult,
            "use_bias": e.use_bias,
        }
    return fp
