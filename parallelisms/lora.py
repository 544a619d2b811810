"""LoRA converter (training.mode = "lora"): adapters on the decoder's projections, on the meta
model, before any parallelism (the converter slot of parallelisms/parallelize.py, after float8 so
that a Float8Linear gets adapters too).

Tensor parallelism then places the adapters with their base layer (tensor_parallel.py), FSDP2
shards them with their decoder layer, activation checkpointing and compile wrap them with it.
`hold_frozen_in` keeps the frozen backbone in the compute dtype: no fp32 master copy, no
gradient, no optimizer state (the memory the mode saves).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engram.config import ConfigError
from engram.config import Lora as LoraConfig
from engram.models.lora import add_lora_adapters
from engram.optim.builder import is_trainable

logger = logging.getLogger("engram.lora")  # shown with the recipe's log (engram.train.metrics)

__all__ = ["apply_lora", "hold_frozen_in"]


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Add adapters to every `cfg.target_modules` projection of `model.layers` in place (works on
    meta and on a pipeline stage); returns the adapted modules' names."""
    adapted = add_lora_adapters(model, cfg)
    if not adapted:
        raise ConfigError(
            "training.mode = 'lora' but this model (stage) has no decoder layer to adapt"
        )
    logger.info(
        f"LoRA rank {cfg.rank}, alpha {cfg.alpha} (scaling {cfg.scaling:g}), dropout "
        f"{cfg.dropout}: {len(adapted)} projections ({', '.join(cfg.target_modules)})"
    )
    return adapted


def hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Cast every floating parameter that lora mode freezes (engram.optim.builder.is_trainable) to `dtype`
    in place (meta ok: the later to_empty / init / HF load fill it in that dtype); returns how
    many were cast."""
    n = 0
    for name, p in model.named_parameters():
        if not is_trainable(name, "lora") and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            n += 1
    return n
