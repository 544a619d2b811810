"""Where an inference model's weights come from: a run's checkpoint, the HF folder or the init."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from torch import nn

from engram.checkpoint import CheckpointError, find_checkpoint, load_model_checkpoint
from engram.checkpoint.fingerprint import config_fingerprint

# The function, not the package attribute: importing engram/checkpoint/step_folders.py (the
# module) rebinds `engram.checkpoint.step_folders` to that module.
from engram.checkpoint.folder import step_folders
from engram.config import JobConfig
from engram.data.tokenizer import load_tokenizer
from engram.hf.load import load_frozen_backbone, load_hf_backbone
from engram.models.builder import build_hasher
from engram.models.transformer import Transformer
from engram.optim.builder import saved_params

logger = logging.getLogger("engram")

SOURCES = ("auto", "checkpoint", "hf", "init")

# Reads a step folder another engine wrote (model, step folder, fingerprint) -> True when it
# was one of its own and is read; e.g. engram/checkpoint/deepspeed_folder.py read_deepspeed_step,
# passed by the callers that read DeepSpeed steps (reading one needs the deepspeed package).
StepReader = Callable[[nn.Module, Path, dict], bool]
EXPORT = "python scripts/export_hf.py --out <folder> --job.config_file <the run's TOML>"


def _engine_of(path: Path) -> str | None:
    """The engine a step folder's fingerprint records (e.g. "deepspeed-zero3"), or None."""
    try:
        return json.loads((path / "fingerprint.json").read_text()).get("engine")
    except (OSError, ValueError, AttributeError):
        return None  # check_fingerprint reports an unreadable fingerprint


def load_checkpoint_weights(
    model: Transformer,
    cfg: JobConfig,
    path: Path,
    fingerprint: dict,
    read_step: StepReader | None = None,
) -> None:
    """The model state of the DCP step folder `path` (verified against its manifest and
    `fingerprint`); a checkpoint.trainable_only one is read on top of the frozen HF backbone.
    A step folder of another engine is read by `read_step`, or refused naming the export."""
    if read_step is not None and read_step(model, path, fingerprint):
        return
    engine = _engine_of(path)
    if engine is not None:
        raise CheckpointError(
            f"checkpoint {path} was written by {engine} (recipes/train_deepspeed.py), which "
            "this caller cannot read: it reads DCP step folders only. Pass "
            "read_step=engram.checkpoint.deepspeed_folder.read_deepspeed_step to load_weights "
            "(recipes/generate.py and scripts/eval_perplexity.py do), or export the step once "
            f"and load the folder with transformers:\n  {EXPORT}"
        )
    load_frozen_backbone(model, cfg)
    load_model_checkpoint(model, path, fingerprint, keep=saved_params(cfg))


def load_weights(
    model: Transformer,
    cfg: JobConfig,
    source: str = "auto",
    checkpoint_step: int = -1,
    fingerprint: dict | None = None,
    read_step: StepReader | None = None,
) -> str:
    """Fill `model` from a checkpoint, the HF folder or keep the init; returns what was used.

    A checkpoint is verified against its manifest and its fingerprint compared with this job's
    (`fingerprint`: config_fingerprint; None computes it) exactly as a training resume does; a
    damaged one is refused (checkpoint.on_damaged = "previous": the newest intact one).
    `read_step` reads step folders of another engine (DeepSpeed: the recipes pass it)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    folder = cfg.run_folder / cfg.checkpoint.folder
    if source in ("auto", "checkpoint"):
        if step_folders(folder):  # checkpoints exist: use one or refuse, never fall back
            path = find_checkpoint(folder, checkpoint_step, cfg.checkpoint.on_damaged)
            if fingerprint is None:
                tokenizer = load_tokenizer(cfg.model.tokenizer_path)
                fingerprint = config_fingerprint(cfg, tokenizer, build_hasher(cfg, tokenizer))
            load_checkpoint_weights(model, cfg, path, fingerprint, read_step)
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
