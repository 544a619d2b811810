"""Reading the files of a DeepSpeed engine checkpoint without running pickled code from them.

DeepSpeed (0.19) reads its checkpoint files with torch.load and `weights_only` off in many
places: its checkpoint engine (`TorchCheckpointEngine.load`: model and ZeRO optimizer states),
the universal-checkpoint loaders (`zero/optimizer_state.pt`, one file per parameter and
moment), zero_to_fp32 and ds_to_universal. A crafted `.pt` file in a step folder would run its
code there, manifest or not (the manifest detects damage, not intent). Every read of DeepSpeed's
files here is done inside `weights_only_loads`: torch's own switch
`TORCH_FORCE_WEIGHTS_ONLY_LOAD=1` turns each of those calls into a weights-only load (torch's
restricted unpickler: tensors, plain containers and numbers), and `DEEPSPEED_CLASSES`, the
three data classes DeepSpeed stores besides those, are allowed for its duration only. Anything
else in a file is refused with a CheckpointError before any of it is built.

Also here: telling a DeepSpeed step folder apart, and reading one into an unsharded model
(export, generation, evaluation: they need no runner/). The engine itself (runner/
deepspeed_engine.py) saves and resumes its folders with the same names and reader.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engram.checkpoint.dcp_io import dcp_load, unpickler_reason
from engram.checkpoint.errors import CheckpointError
from engram.checkpoint.folder import check_fingerprint
from engram.checkpoint.state import ModelState
from engram.models.engram import EngramTable
from engram.models.transformer import clean_fqn

ENGINE_TAG = "model"  # engine checkpoint: <step folder>/engine/model/ (+ engine/latest)
FORCE, FORCE_NO = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"

# What DeepSpeed 0.19's ZeRO-1/2/3 files hold besides tensors and containers (listed by
# torch.serialization.get_unsafe_globals_in_checkpoint over fp32 / bf16, offload and universal
# checkpoints): plain data classes whose unpickling sets attributes and runs no other code.
DEEPSPEED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # the optimizer's (static) loss scale
    "deepspeed.runtime.zero.config.ZeroStageEnum",  # the saved ZeRO stage (an int enum)
    "deepspeed.utils.tensor_fragment.fragment_address",  # numel / start of a parameter slice
)


def _classes() -> list[type]:
    import importlib

    found = []
    for path in DEEPSPEED_CLASSES:
        module, _, name = path.rpartition(".")
        found.append(getattr(importlib.import_module(module), name))
    return found


@contextmanager
def weights_only_loads(what: Path) -> Iterator[None]:
    """Inside: every torch.load of this process is weights-only, DeepSpeed's too (they turn
    `weights_only` off), and may build DEEPSPEED_CLASSES besides tensors; a file holding
    anything else raises a CheckpointError naming `what` (the checkpoint being read). Process
    wide while it lasts (an environment variable): use it around a load, not around training."""
    saved = {k: os.environ.get(k) for k in (FORCE, FORCE_NO)}
    os.environ[FORCE] = "1"
    os.environ.pop(FORCE_NO, None)  # torch refuses both at once; ours wins while we read
    try:
        with torch.serialization.safe_globals(_classes()):
            yield
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"the DeepSpeed checkpoint {what} holds a pickled object that is not plain data: "
            f"refusing to load it (files are read weights-only, with DeepSpeed's classes "
            f"{', '.join(c.rpartition('.')[2] for c in DEEPSPEED_CLASSES)} allowed; "
            f"torch: {unpickler_reason(e)}). Resume from another checkpoint (checkpoint.load_step) or "
            "one written by a run you trust"
        ) from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def is_deepspeed_step(step_dir: Path) -> bool:
    """`step_dir` was written by recipes/train_deepspeed.py (it holds an engine checkpoint)."""
    return (Path(step_dir) / "engine" / ENGINE_TAG).is_dir()


def register_at(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Register `module` under `root` at the dotted path `fqn`, creating empty parents."""
    *parents, leaf = fqn.split(".")
    node = root
    for name in parents:
        if name not in node._modules:
            node.add_module(name, nn.Module())
        node = node._modules[name]
    node.add_module(leaf, module)


def load_deepspeed_weights(
    model: nn.Module, step_dir: Path, fingerprint: dict[str, Any] | None = None
) -> None:
    """Fill an unsharded model (export, generation) from a step folder of train_deepspeed.py,
    in one process: the engine's fp32 master weights consolidated by DeepSpeed's zero_to_fp32
    (any ZeRO stage, any saved world size; read weights-only) and the Engram tables from their
    DCP shards (engram.checkpoint.dcp_load, the restricted reader). `fingerprint` (this job's
    config_fingerprint): any difference but the engine is refused."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    step_dir = Path(step_dir)
    if fingerprint is not None:
        check_fingerprint(step_dir, fingerprint, ignore=("engine",))
    with weights_only_loads(step_dir):
        dense = get_fp32_state_dict_from_zero_checkpoint(str(step_dir / "engine"), tag=ENGINE_TAG)
    dense = {clean_fqn(k): v for k, v in dense.items()}
    tables = nn.Module()
    for fqn, table in model.named_modules():
        if isinstance(table, EngramTable):
            register_at(tables, clean_fqn(fqn), table)
    table_keys = {f"{clean_fqn(n)}" for n, _ in tables.named_parameters()}
    missing, unexpected = model.load_state_dict(dense, strict=False)
    missing = {clean_fqn(k) for k in missing} - table_keys
    if missing or unexpected:
        raise CheckpointError(
            f"the engine checkpoint in {step_dir} does not fit this model: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}. Fix: pass the config "
            "file the run was trained with"
        )
    if table_keys:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load({"tables": ModelState(tables)}, step_dir, no_dist=True)


def read_deepspeed_step(model: nn.Module, step_dir: Path, fingerprint: dict[str, Any]) -> bool:
    """A step reader for engram.inference.load_weights: reads `step_dir` into `model` and
    returns True when it is a DeepSpeed step folder; False (nothing read) otherwise."""
    if not is_deepspeed_step(step_dir):
        return False
    load_deepspeed_weights(model, step_dir, fingerprint)
    return True
