"""Activation checkpointing of decoder layers: none | full (every layer) | selective (every k-th)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from engram.config import ActivationCheckpoint


def apply_activation_checkpointing(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Wrap decoder layers in place; parameter names keep working through DCP's state-dict API."""
    if cfg.mode == "none":
        return
    every = 1 if cfg.mode == "full" else cfg.selective_every
    for i, (name, layer) in enumerate(list(model.layers.named_children())):
        if i % every == 0:
            model.layers.register_module(name, checkpoint_wrapper(layer, preserve_rng_state=False))
