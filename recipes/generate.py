"""Generate text with a model of a training run. Copy this file and edit it; it reads top to bottom.

    python recipes/generate.py --job.config_file train_configs/debug_model.toml \
        --prompt "The capital of" [--max_new_tokens 32 --temperature 0 --top_k 0 \
        --checkpoint_step -1 --source auto --prefix eos] [--section.key=value ...]

One process, one device (`job.device`). The model is built as recipes/train.py builds it (same
config, tokenizer and Engram hasher; engram/inference/build.py), then its weights come from
(`--source auto` tries them in this order; engram/inference/weights.py):

  checkpoint  the run's newest DCP checkpoint (or `--checkpoint_step N`), model state only,
              verified against its manifest and fingerprint as a training resume verifies it
              (engram/checkpoint/ find_checkpoint / load_model_checkpoint). DCP reshards: a
              checkpoint saved by N ranks (FSDP2 shards, row-sharded Engram tables) loads into
              this unsharded model. A step of recipes/train_deepspeed.py is read as
              scripts/export_hf.py reads it (engram/checkpoint/deepspeed_folder.py: zero_to_fp32 +
              the tables' DCP shards). When the run has checkpoints, a damaged one is an
              error, never a fallback to hf / init.
  hf          the Hugging Face folder in `model.hf_checkpoint` (backbone; Engram keeps its init)
  init        the deterministic random init of `job.seed` (a smoke test, not a language model)

Decoding (engram/inference/decode.py) is token by token with a KV cache
(engram/models/decode_cache.py): the prompt runs once, then each step runs only the newest token.
Engram needs the hash ids of the new position, which depend on the last max_ngram tokens (hashed
on the model's device with `NgramHasher.hash_torch`), and the ShortConv window of the last
(kernel_size - 1) x dilation positions, kept in the cache. `--no_cache` recomputes the whole
sequence every step instead (O(T^2); the reference the cached path is tested against). Greedy at
temperature 0, else sampling (optionally top-k; engram/inference/sampling.py).
Output rows past the tokenizer's vocabulary (padded embeddings, e.g. Qwen2.5) are never sampled.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch

from engram.checkpoint.deepspeed_folder import read_deepspeed_step
from engram.checkpoint.fingerprint import config_fingerprint
from engram.config import JobConfig, load_config
from engram.data.tokenizer import load_tokenizer
from engram.inference import (
    SOURCES,
    build_for_generation,
    encode_prompt,
    generate,
    load_weights,
    warn_if_longer_than_trained,
)
from engram.runtime import device as dev
from engram.runtime.logs import init_logging

logger = logging.getLogger("engram")


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


def main(argv: list[str] | None = None) -> str:
    args, cfg = parse_args(argv)
    init_logging(0)
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
    source = load_weights(
        model, cfg, args.source, args.checkpoint_step, fingerprint, read_deepspeed_step
    )
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
