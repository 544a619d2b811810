"""The Stateful wrappers a checkpoint saves: model, optimizers, loop counters, RNG.

Model and optimizer state are DTensor-aware (FSDP2 shards, row-sharded Engram tables), so they
reload at another world size and layout. TrainState is stored as tensors (nothing pickled);
RNGState is plain JSON, one file per rank (CheckpointManager writes it).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

logger = logging.getLogger("engram")

# Flattened optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") merges several
# optimizers into one dict and survives a regrouping of parameters.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_PARAM_GROUPS = "param_groups."


class ModelState(Stateful):
    """A model (or its pipeline parts), FSDP2-wrapped or not, as DCP state.

    Sharded parameters stay DTensors in the state dict, so DCP writes each shard once and
    reshards on load (different world size or parallel layout)."""

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        keep: Callable[[str], bool] | None = None,
    ):
        """`keep`: save / load only the entries whose name it accepts (checkpoint.trainable_only:
        the frozen backbone comes from the HF folder or the seed instead)."""
        self.parts = [model] if isinstance(model, nn.Module) else list(model)
        self.keep = keep

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        if self.keep is not None:
            merged = {k: v for k, v in merged.items() if self.keep(k)}
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each pipeline part takes its own keys from the merged dict.
        strict = len(self.parts) == 1 and self.keep is None
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=strict))

    def all_finite(self) -> bool:
        """This rank's parameters and buffers are all finite (local shards only; an NVMe table's
        rows are in its store, not checked). Call it with no host-table update in flight."""
        with torch.no_grad():  # no autograd view of a table the host worker updates in place
            for part in self.parts:
                for t in list(part.parameters()) + list(part.buffers()):
                    local = t.to_local() if isinstance(t, DTensor) else t
                    if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                        return False
        return True


class OptimizerState(Stateful):
    """One or more optimizers over (disjoint parameter sets of) one model, as DCP state.

    Pipeline parts: pass the parts and, per part, its optimizers. Each part's state is keyed by
    its own parameter names (global: stages keep the unsplit model's names), so a rank holding
    two stages saves and loads the same keys as any other layout (a ModuleList of the parts
    would prefix them with the part's index and resume only at the same placement)."""

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizers: torch.optim.Optimizer | Sequence[Any],
    ):
        if isinstance(model, nn.Module):
            opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers
            self.pairs = [(model, list(opts))]
        else:
            self.pairs = [(part, list(opts)) for part, opts in zip(model, optimizers, strict=True)]

    def _flat(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, opts in self.pairs:
            merged.update(get_optimizer_state_dict(part, opts, options=_OPTIM_OPTIONS))
        return merged

    def state_dict(self) -> dict[str, Any]:
        """The per-parameter state (moments, step counts: tensors) only. The param groups'
        hyperparameters (lr, betas, eps, weight_decay, ...) are not saved: they come from the
        config, so a resume with a changed value uses it from its first step."""
        return {k: v for k, v in self._flat().items() if not k.startswith(_PARAM_GROUPS)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # This run's hyperparameters complete the loaded state (torch needs both); each part
        # reads its own parameters' keys from the merged, flattened dict.
        current = {k: v for k, v in self._flat().items() if k.startswith(_PARAM_GROUPS)}
        state_dict = {**state_dict, **current}
        for part, opts in self.pairs:
            set_optimizer_state_dict(part, opts, state_dict, options=_OPTIM_OPTIONS)


@dataclass
class TrainState(Stateful):
    """Loop counters. Values must be global (equal on all ranks): DCP stores one copy.

    Stored as int64 tensors, so DCP reads them without unpickling."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class RNGState:
    """Python, numpy, torch CPU and current-accelerator RNG states of this process, as JSON."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state().tolist(),
        }
        # check_available: a CUDA build of torch on a machine without a GPU (the registry's Linux
        # wheels) reports cuda as its accelerator, and reading its RNG state would fail.
        acc = torch.accelerator.current_accelerator(check_available=True)
        if acc is not None:
            rng = torch.get_device_module(acc.type).get_rng_state()
            state["accelerator"] = [acc.type, rng.tolist()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        saved = state.get("accelerator")
        acc = torch.accelerator.current_accelerator(check_available=True)
        if saved is not None and acc is not None and saved[0] == acc.type:
            rng = torch.tensor(saved[1], dtype=torch.uint8)
            torch.get_device_module(acc.type).set_rng_state(rng)
        elif saved is not None or acc is not None:
            logger.warning(
                "checkpoint accelerator RNG (%s) does not match this device (%s): not restored",
                saved[0] if saved else None,
                acc.type if acc else None,
            )
