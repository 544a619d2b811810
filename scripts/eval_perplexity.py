"""Held-out perplexity of a run's checkpoint on its data's held-out split, without training.

    PYTHONPATH=. python scripts/eval_perplexity.py --job.config_file train_configs/debug_model.toml \
        --data.dataset=tokens --data.path=data/my_corpus [--batches 16] [--checkpoint_step N] \
        [--source auto|checkpoint|hf|init] [--section.key=value ...]

The model is built and its weights chosen exactly as recipes/generate.py does (engram/inference/:
the run's newest checkpoint, else model.hf_checkpoint, else the init; DCP reshards any training
layout into this one process). Batches are the training data loader's "val" split (data.dataset =
"tokens": ~1% of the prepared chunks, never trained on; text / jsonl: ~1% of the documents),
local_batch_size x seq_len tokens each, with the loader's Engram hash ids. Prints and returns the
token-weighted mean loss and exp(loss). One process, one device (job.device).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.checkpoint.deepspeed_folder import read_deepspeed_step  # noqa: E402
from engram.config import load_config  # noqa: E402
from engram.data.loader import build_dataloader  # noqa: E402
from engram.inference import SOURCES, build_for_generation, load_weights  # noqa: E402
from engram.runtime import device as dev  # noqa: E402
from engram.runtime.logs import init_logging  # noqa: E402
from engram.train.step import model_inputs  # noqa: E402


@torch.no_grad()
def heldout_loss(model, loader, batches: int, device) -> tuple[float, int]:
    """(token-weighted mean cross entropy, tokens scored) over `batches` batches of `loader`."""
    total = torch.zeros((), dtype=torch.float64)
    tokens = 0
    it = iter(loader)
    for _ in range(batches):
        batch = {k: v.to(device) for k, v in next(it).items()}
        logits = model(batch["input_ids"], **model_inputs(batch))
        labels = batch["labels"]
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        total += loss.double().cpu()
        tokens += int((labels != -100).sum())
    return float(total) / max(tokens, 1), tokens


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=16, help="held-out batches to score")
    parser.add_argument("--checkpoint_step", type=int, default=-1, help="-1: the newest")
    parser.add_argument("--source", choices=SOURCES, default="auto")
    ns, rest = parser.parse_known_args(argv)
    if ns.batches <= 0:
        parser.error("--batches must be > 0")
    cfg = load_config(rest)
    init_logging(0)
    device_type = dev.resolve_device_type(cfg.job.device)
    dev.import_device_backend(device_type)
    device = dev.local_device(device_type, 0)
    model, tokenizer, hasher = build_for_generation(cfg, cfg.training.seq_len, device)
    source = load_weights(model, cfg, ns.source, ns.checkpoint_step, read_step=read_deepspeed_step)
    loader = build_dataloader(cfg, tokenizer, hasher, 0, 1, split="val")
    loss, tokens = heldout_loss(model, loader, ns.batches, device)
    result = {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens}
    print(
        f"held-out ({cfg.data.dataset}) loss {loss:.4f}, perplexity {result['perplexity']:.3f} "
        f"over {tokens} tokens ({ns.batches} batches of {cfg.training.local_batch_size} x "
        f"{cfg.training.seq_len}); weights: {source}"
    )
    return result


if __name__ == "__main__":
    main()
