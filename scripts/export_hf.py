"""Export a training checkpoint as safetensors: the safe way to share weights.

    PYTHONPATH=. python scripts/export_hf.py --job.config_file train_configs/debug_model.toml \
        --out exported/ [--step N] [--engram-only] [--overwrite] [--section.key=value ...]

(a) default: a self-contained Hugging Face folder (engram/hf/export.py): transformers loads it as
    the full Engram model with AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    (modeling_engram.py beside config.json; without the flag transformers refuses it) and
    AutoTokenizer.from_pretrained(out, trust_remote_code=True); this repo
    loads it into any layout with model.hf_checkpoint = <folder>. config.json states the repo
    version, the checkpoint fingerprint and the training config it came from.
(b) --engram-only: engram.safetensors alone (engram.hf.export.load_engram_safetensors reads it).
(c) training.mode = "lora": a PEFT adapter folder (adapter_config.json, adapter_model.safetensors
    in PEFT's key names: `PeftModel.from_pretrained(base, folder)` on the transformers base model)
    plus engram.safetensors; with --merged instead the HF folder of (a) with the adapters folded
    into the base weights (W + alpha / r * B A). A checkpoint.trainable_only checkpoint is read on
    top of model.hf_checkpoint.

The checkpoint is the run's newest one (or --step), verified against its manifest and its
fingerprint first (engram/checkpoint/ find_checkpoint, engram/inference/ load_checkpoint_weights,
as generation).
--out must be new or empty; --overwrite removes its model files first (an export beside an
earlier one's shards and index would mix two models). A run's folder (or a folder inside one or
holding the checkpoint) is refused as --out. Every folder gets checksums.sha256
(`sha256sum -c checksums.sha256` checks it; our readers verify it). It runs in one process (no
GPU needed); DCP reshards whatever layout the run was saved with. A checkpoint of recipes/train_deepspeed.py is
read with DeepSpeed's zero_to_fp32 (docs/deepspeed.md). The work is engram/inference/export_run.py's,
which the training recipes also run at the end of a run with export.folder set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.config import load_config  # noqa: E402
from engram.inference.export_run import export_checkpoint  # noqa: E402
from engram.runtime.logs import init_logging  # noqa: E402


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output folder (new or empty)")
    parser.add_argument("--step", type=int, default=-1, help="checkpoint step (-1: newest)")
    parser.add_argument("--engram-only", action="store_true", help="write engram.safetensors only")
    parser.add_argument(
        "--merged",
        action="store_true",
        help="lora mode: fold the adapters into the base weights and write the HF folder",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="export into a non-empty --out: remove its model files first",
    )
    ns, rest = parser.parse_known_args(argv)
    cfg = load_config(rest)
    init_logging(0)
    files = export_checkpoint(cfg, ns.out, ns.step, ns.merged, ns.engram_only, ns.overwrite)
    for f in files:
        print(f"wrote {f}")
    return files


if __name__ == "__main__":
    main()
