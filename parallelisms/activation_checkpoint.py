"""Activation checkpointing of decoder layers: none | full (every layer) | selective (every k-th)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from engram.config import ActivationCheckpoint


def checkpoint_every(cfg: ActivationCheckpoint) -> int:
    """Every how many decoder layers one is wrapped (0: none)."""
    return {"none": 0, "full": 1, "selective": cfg.selective_every}[cfg.mode]


def is_checkpointed(cfg: ActivationCheckpoint, position: int) -> bool:
    """Whether the decoder layer at `position` of a model (or pipeline stage) is wrapped."""
    every = checkpoint_every(cfg)
    return bool(every) and position % every == 0


def apply_activation_checkpointing(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Wrap decoder layers in place; parameter names keep working through DCP's state-dict API."""
    for i, (name, layer) in enumerate(list(model.layers.named_children())):
        if is_checkpointed(cfg, i):
            model.layers.register_module(name, checkpoint_wrapper(layer, preserve_rng_state=False))
