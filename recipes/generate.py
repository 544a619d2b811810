"""Generate text with a model of a training run. Copy this file and edit it; it reads top to bottom.

    python recipes/generate.py --job.config_file train_configs/debug_model.toml \
        --prompt "The capital of" [--max_new_tokens 32 --temperature 0 --top_k 0 \
        --checkpoint_step -1 --source auto --prefix eos] [--section.key=value ...]

One process, one device (`job.device`). The model is built as recipes/train.py builds it (same
config, tokenizer and Engram hasher), then its weights come from (`--source auto` tries them in
this order):

  checkpoint  the run's newest DCP checkpoint (or `--checkpoint_step N`), model state only,
              verified against its manifest and fingerprint as a training resume verifies it
              (engram/checkpoint/ find_checkpoint / load_model_checkpoint). DCP reshards: a
              checkpoint saved by N ranks (FSDP2 shards, row-sharded Engram tables) loads into
              this unsharded model. When the run has checkpoints, a damaged one is an error,
              never a fallback to hf / init.
  hf          the Hugging Face folder in `model.hf_checkpoint` (backbone; Engram keeps its init)
  init        the deterministic random init of `job.seed` (a smoke test, not a language model)

Decoding is token by token with a KV cache (engram/models/decode_cache.py): the prompt runs once,
then each step runs only the newest token. Engram needs the hash ids of the new position, which
depend on the last max_ngram tokens (hashed on the model's device with `NgramHasher.hash_torch`),
and the ShortConv window of the last (kernel_size - 1) x dilation positions, kept in the cache.
`--no_cache` recomputes the whole sequence every step instead (O(T^2); the reference the cached
path is tested against). Greedy at temperature 0, else sampling (optionally top-k).
Output rows past the tokenizer's vocabulary (padded embeddings, e.g. Qwen2.5) are never sampled.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch

from engram.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_model_checkpoint,
    step_folders,
)
from engram.checkpoint.fingerprint import config_fingerprint
from engram.config import JobConfig, load_config
from engram.data.tokenizer import Tokenizer, load_tokenizer
from engram.hashing.ngram import NgramHasher
from engram.hf.load import load_frozen_backbone, load_hf_backbone
from engram.models.builder import build_for_inference, build_hasher
from engram.models.decode_cache import DecodeCache
from engram.models.transformer import Transformer
from engram.optim.builder import saved_params
from engram.runtime import device as dev
from engram.train.metrics import init_logger

logger = logging.getLogger("engram")

SOURCES = ("auto", "checkpoint", "hf", "init")


@dataclass
class GenerateArgs:
    prompt: str = "The capital of"
    max_new_tokens: int = 32
    temperature: float = 0.0
    """0: greedy (argmax)."""
    top_k: int = 0
    """Sample only among the k most likely tokens; 0: all tokens."""
    checkpoint_step: int = -1
    """-1: the newest complete checkpoint of the run."""
    source: str = "auto"
    """auto | checkpoint | hf | init (see the module docstring)."""
    prefix: str = "eos"
    """Token put before the prompt: eos (how our packer starts a document), bos, or none."""
    seed: int | None = None
    """Sampling seed; None: job.seed."""
    no_cache: bool = False
    """Recompute the whole sequence every step (no KV cache)."""


def parse_args(argv: list[str] | None = None) -> tuple[GenerateArgs, JobConfig]:
    """Generation flags; everything else is the training config (--job.config_file, overrides)."""
    parser = argparse.ArgumentParser(
        description="Generate text with a model of a training run. Other flags are training "
        "config flags: --job.config_file PATH and --section.key=value overrides.",
        allow_abbrev=False,
    )
    d = GenerateArgs()
    parser.add_argument("--prompt", default=d.prompt)
    parser.add_argument("--max_new_tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--top_k", type=int, default=d.top_k)
    parser.add_argument("--checkpoint_step", type=int, default=d.checkpoint_step)
    parser.add_argument("--source", choices=SOURCES, default=d.source)
    parser.add_argument("--prefix", choices=("eos", "bos", "none"), default=d.prefix)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no_cache", action="store_true")
    ns, rest = parser.parse_known_args(argv)
    args = GenerateArgs(**vars(ns))
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        parser.error("--max_new_tokens, --temperature and --top_k must be >= 0")
    return args, load_config(rest)


# --- model -------------------------------------------------------------------------------------


def build_for_generation(
    cfg: JobConfig,
    max_seq_len: int,
    device: torch.device | str = "cpu",
    tokenizer: Tokenizer | None = None,
) -> tuple[Transformer, Tokenizer, NgramHasher | None]:
    """The training recipe's model, unsharded on `device`, initialised with job.seed.

    `max_seq_len` sizes the RoPE table (the prompt plus the new tokens may exceed seq_len)."""
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    model, hasher = build_for_inference(cfg, tokenizer, max_seq_len, device)
    return model, tokenizer, hasher


def load_weights(
    model: Transformer,
    cfg: JobConfig,
    source: str = "auto",
    checkpoint_step: int = -1,
    fingerprint: dict | None = None,
) -> str:
    """Fill `model` from a checkpoint, the HF folder or keep the init; returns what was used.

    A checkpoint is verified against its manifest and its fingerprint compared with this job's
    (`fingerprint`: config_fingerprint; None computes it) exactly as a training resume does; a
    damaged one is refused (checkpoint.on_damaged = "previous": the newest intact one)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    folder = cfg.run_folder / cfg.checkpoint.folder
    if source in ("auto", "checkpoint"):
        if step_folders(folder):  # checkpoints exist: use one or refuse, never fall back
            path = find_checkpoint(folder, checkpoint_step, cfg.checkpoint.on_damaged)
            if fingerprint is None:
                tokenizer = load_tokenizer(cfg.model.tokenizer_path)
                fingerprint = config_fingerprint(cfg, tokenizer, build_hasher(cfg, tokenizer))
            load_frozen_backbone(model, cfg)
            load_model_checkpoint(model, path, fingerprint, keep=saved_params(cfg))
            return f"checkpoint {path}"
        if source == "checkpoint" or checkpoint_step >= 0:
            raise CheckpointError(
                f"no complete checkpoint in {folder}: train with --checkpoint.enable=true (same "
                "job.dump_folder / job.run_name), or use --source hf / --source init"
            )
    if source in ("auto", "hf") and cfg.model.hf_checkpoint:
        load_hf_backbone(model, cfg.model.hf_checkpoint, model.args)
        return f"HF checkpoint {cfg.model.hf_checkpoint}"
    if source == "hf":
        raise ValueError("--source hf needs model.hf_checkpoint (--model.hf_checkpoint=FOLDER)")
    logger.warning("no checkpoint and no model.hf_checkpoint: generating from random weights")
    return f"random init (job.seed {cfg.job.seed})"


def warn_if_longer_than_trained(cfg: JobConfig, prompt_tokens: int, max_new_tokens: int) -> None:
    """Positions past training.seq_len were never trained: say so when a generation uses them."""
    total = prompt_tokens + max_new_tokens
    if total > cfg.training.seq_len:
        logger.warning(
            "the prompt (%d tokens) + max_new_tokens (%d) = %d positions exceed training.seq_len "
            "= %d: the model never saw positions past %d, and its output there is unreliable. "
            "Shorten the prompt or --max_new_tokens",
            prompt_tokens,
            max_new_tokens,
            total,
            cfg.training.seq_len,
            cfg.training.seq_len,
        )


# --- decoding ----------------------------------------------------------------------------------


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    input_ids: torch.Tensor,
    hasher: NgramHasher | None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """input_ids [B, T] (or [T]) -> [B, T + n] with n <= max_new_tokens new tokens.

    With `use_cache` the prompt runs once and each step runs the newest token against the KV
    cache; else each step runs the full sequence. Hash ids are computed on the model's device
    (for the newest positions: from the last max_ngram tokens only). Stops early once every
    row has produced `eos_id`; finished rows are padded with it. `vocab_size` (the tokenizer's):
    output rows past it (padding, e.g. Qwen2.5's 152,064 rows for 151,665 tokens) are never
    chosen, so every id can be decoded and hashed."""
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    device = model.rope_cache.device
    ids = ids.to(device=device, dtype=torch.long)
    if ids.shape[1] + max_new_tokens > model.args.max_seq_len:
        raise ValueError(
            f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's max_seq_len {model.args.max_seq_len}: build it with a larger max_seq_len"
        )
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token (or use --prefix eos)")
    if vocab_size is not None and not 0 < vocab_size <= model.args.vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} must be in 1..{model.args.vocab_size} (the output rows)"
        )
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    cache = DecodeCache() if use_cache else None
    for _ in range(max_new_tokens):
        start = 0 if cache is None else cache.pos
        hash_ids = None
        if hasher is not None:  # position t hashes tokens t - max_ngram + 1 .. t
            window = ids[:, max(0, start - hasher.max_ngram + 1) :]
            hash_ids = hasher.hash_torch(window)[:, start - ids.shape[1] :].to(device)
        logits = model(ids[:, start:], hash_ids=hash_ids, cache=cache, last_positions=1)[:, -1]
        if vocab_size is not None:
            logits[:, vocab_size:] = float("-inf")
        nxt = sample_next(logits, temperature, top_k, generator)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if eos_id is not None and bool(done.all()):
            break
    return ids


def encode_prompt(tokenizer: Tokenizer, prompt: str, prefix: str) -> list[int]:
    ids = tokenizer.encode(prompt)
    if prefix == "eos":
        return [tokenizer.eos_id, *ids]
    if prefix == "bos":
        if tokenizer.bos_id is None:
            raise ValueError(f"{tokenizer.source} has no bos token: use --prefix eos or none")
        return [tokenizer.bos_id, *ids]
    return ids


def main(argv: list[str] | None = None) -> str:
    args, cfg = parse_args(argv)
    init_logger(0)
    device_type = dev.resolve_device_type(cfg.job.device)
    dev.import_device_backend(device_type)
    device = dev.local_device(device_type, 0)

    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    prompt_ids = encode_prompt(tokenizer, args.prompt, args.prefix)
    model, tokenizer, hasher = build_for_generation(
        cfg, len(prompt_ids) + args.max_new_tokens, device, tokenizer
    )
    warn_if_longer_than_trained(cfg, len(prompt_ids), args.max_new_tokens)
    fingerprint = config_fingerprint(cfg, tokenizer, hasher)
    source = load_weights(model, cfg, args.source, args.checkpoint_step, fingerprint)
    logger.info(f"model {cfg.model.name}/{cfg.model.flavor} on {device}, weights: {source}")

    generator = torch.Generator(device=device).manual_seed(
        cfg.job.seed if args.seed is None else args.seed
    )
    out = generate(
        model,
        torch.tensor([prompt_ids]),
        hasher,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        eos_id=tokenizer.eos_id,
        generator=generator,
        vocab_size=tokenizer.vocab_size,
        use_cache=not args.no_cache,
    )
    completion = tokenizer.decode(out[0, len(prompt_ids) :].tolist())
    print(f"{args.prompt}{completion}")
    return completion


if __name__ == "__main__":
    main()
