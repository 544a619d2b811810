"""Where an inference model's weights come from: a run's checkpoint, the HF folder or the init."""

from __future__ import annotations

import logging
from pathlib import Path

from engram.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_model_checkpoint,
    step_folders,
)
from engram.checkpoint.fingerprint import config_fingerprint
from engram.config import JobConfig
from engram.data.tokenizer import load_tokenizer
from engram.hf.load import load_frozen_backbone, load_hf_backbone
from engram.models.builder import build_hasher
from engram.models.transformer import Transformer
from engram.optim.builder import saved_params

logger = logging.getLogger("engram")

SOURCES = ("auto", "checkpoint", "hf", "init")


def load_checkpoint_weights(
    model: Transformer, cfg: JobConfig, path: Path, fingerprint: dict
) -> None:
    """The model state of the DCP step folder `path` (verified against its manifest and
    `fingerprint`); a checkpoint.trainable_only one is read on top of the frozen HF backbone."""
    load_frozen_backbone(model, cfg)
    load_model_checkpoint(model, path, fingerprint, keep=saved_params(cfg))


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
            load_checkpoint_weights(model, cfg, path, fingerprint)
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
