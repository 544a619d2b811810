"""A run's checkpoint -> an export folder: what scripts/export_hf.py does, and what the training
recipes do at the end of a run with `export.folder` set (runner/loop.py run_recipe).

The checkpoint (the newest, or `step`) is verified against its manifest and the run's fingerprint
and read into one unsharded model (DCP reshards any layout; a DeepSpeed step is read with its
zero_to_fp32). Then: the Hugging Face folder (engram/hf/export.py), `engram_only` its
engram.safetensors alone, or for training.mode = "lora" the PEFT adapter folder
(engram/hf/peft.py) unless `merged` folds the adapters into the base weights first.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from engram.checkpoint import find_checkpoint
from engram.checkpoint.deepspeed_folder import is_deepspeed_step, load_deepspeed_weights
from engram.checkpoint.fingerprint import config_fingerprint
from engram.config import JobConfig, to_toml
from engram.hf.export import check_not_run_folder, export, prepare_output_folder
from engram.hf.peft import export_peft
from engram.inference.build import build_for_generation
from engram.inference.weights import load_checkpoint_weights
from engram.models.lora import merge_lora_

logger = logging.getLogger("engram")


def export_checkpoint(
    cfg: JobConfig,
    out: str | Path,
    step: int = -1,
    merged: bool = False,
    engram_only: bool = False,
    overwrite: bool = False,
) -> list[Path]:
    """Export step `step` (-1: the newest) of the run of `cfg` into `out`; returns the files."""
    path = find_checkpoint(cfg.run_folder / cfg.checkpoint.folder, step)
    check_not_run_folder(out, path, cfg.checkpoint.folder)  # before the (long) load
    if merged and cfg.training.mode != "lora":
        raise SystemExit("--merged folds LoRA adapters: the run's training.mode is not lora")
    model, tokenizer, hasher = build_for_generation(cfg, cfg.training.seq_len)
    fingerprint = config_fingerprint(cfg, tokenizer, hasher)
    if is_deepspeed_step(path):  # written by recipes/train_deepspeed.py
        load_deepspeed_weights(model, path, fingerprint)
    else:
        load_checkpoint_weights(model, cfg, path, fingerprint)
    prepare_output_folder(out, overwrite, path, cfg.checkpoint.folder)
    engram_config = dataclasses.asdict(cfg.engram)
    if cfg.training.mode == "lora" and not (merged or engram_only):
        return export_peft(model, cfg, path, engram_config, fingerprint, out)
    merge_lora_(model)
    return export(
        model,
        cfg.model.name,
        engram_config,
        fingerprint,
        out,
        engram_only=engram_only,
        tokenizer=tokenizer,
        hasher=hasher,
        config_toml=to_toml(cfg),
        chat_template=cfg.data.chat_template,
    )


def export_at_end(cfg: JobConfig) -> list[Path]:
    """`export.folder` after training (one process): the last checkpoint, replacing the folder's
    model files (export.lora chooses a LoRA run's folder)."""
    merged = cfg.training.mode == "lora" and cfg.export.lora == "merged"
    files = export_checkpoint(cfg, cfg.export.folder, merged=merged, overwrite=True)
    logger.info(f"exported the last checkpoint to {cfg.export.folder} ({len(files)} files)")
    return files
