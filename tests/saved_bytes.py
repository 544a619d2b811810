"""Bytes autograd saves for backward in one forward call: what the planner's activation model
predicts (parameters and buffers, which autograd also references, are left out)."""

from __future__ import annotations

import torch
from torch import nn


def saved_activation_bytes(model: nn.Module, *args, **kwargs) -> int:
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args, **kwargs)
    return sum(n for ptr, n in saved.items() if ptr not in held)
