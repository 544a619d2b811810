"""Export a training checkpoint as safetensors: the safe way to share weights.

    PYTHONPATH=. python scripts/export_hf.py --job.config_file train_configs/debug_model.toml \
        --out exported/ [--step N] [--engram-only] [--section.key=value ...]

(a) default: a Hugging Face folder (config.json, model.safetensors with the backbone in HF
    Llama/Qwen names, tokenizer.json) plus engram.safetensors (Engram weights, with the Engram
    config and the checkpoint fingerprint as JSON in its header). Load it into any layout with
    model.hf_checkpoint = <folder> (engram/hf_load.py reads the Engram tensors too).
(b) --engram-only: engram.safetensors alone (engram.export.load_engram_safetensors reads it).

The checkpoint is the run's newest intact one (or --step), verified against its manifest first.
It runs in one process (no GPU needed); DCP reshards whatever layout the run was saved with. A
checkpoint of recipes/train_deepspeed.py is read with DeepSpeed's zero_to_fp32 (docs/deepspeed.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.checkpoint import CheckpointError, verify_checkpoint  # noqa: E402
from engram.config import load_config  # noqa: E402
from engram.export import export  # noqa: E402
from engram.fingerprint import config_fingerprint  # noqa: E402
from parallelisms.deepspeed_engine import is_deepspeed_step, load_deepspeed_weights  # noqa: E402
from recipes.generate import build_for_generation, checkpoint_steps, load_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--step", type=int, default=-1, help="checkpoint step (-1: newest)")
    parser.add_argument("--engram-only", action="store_true", help="write engram.safetensors only")
    ns, rest = parser.parse_known_args(argv)
    cfg = load_config(rest)
    steps = checkpoint_steps(cfg)
    if not steps:
        raise SystemExit(f"no checkpoint in {cfg.run_folder / cfg.checkpoint.folder}")
    step = steps[-1] if ns.step < 0 else ns.step
    path = cfg.run_folder / cfg.checkpoint.folder / f"step-{step}"
    problems = verify_checkpoint(path, collective=False)
    if problems:
        raise CheckpointError("not exporting a damaged checkpoint:\n  " + "\n  ".join(problems))
    model, tokenizer, hasher = build_for_generation(cfg, cfg.training.seq_len)
    if is_deepspeed_step(path):  # written by recipes/train_deepspeed.py
        load_deepspeed_weights(model, path)
    else:
        load_checkpoint(model, cfg, step)
    files = export(
        model,
        cfg.model.name,
        dataclasses.asdict(cfg.engram),
        config_fingerprint(cfg, tokenizer, hasher),
        ns.out,
        engram_only=ns.engram_only,
        tokenizer_file=tokenizer.source or None,
    )
    for f in files:
        print(f"wrote {f}")
    return files


if __name__ == "__main__":
    main()
