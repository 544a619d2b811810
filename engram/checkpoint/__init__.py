"""Checkpoints: DCP step folders with a manifest, the config fingerprint, safe reading.

- `manager.py`: `CheckpointManager` (save / async save / load / prune / resume).
- `fingerprint.py`: what of the config a checkpoint must agree with to be resumed.

The names below are the package's public API (`from engram.checkpoint import ...`).
"""

from engram.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    ModelState,
    OptimizerState,
    TrainState,
    add_to_manifest,
    check_fingerprint,
    file_checksum,
    find_checkpoint,
    fingerprint_mismatches,
    load_model_checkpoint,
    read_manifest,
    step_folders,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ModelState",
    "OptimizerState",
    "TrainState",
    "add_to_manifest",
    "check_fingerprint",
    "file_checksum",
    "find_checkpoint",
    "fingerprint_mismatches",
    "load_model_checkpoint",
    "read_manifest",
    "step_folders",
    "verify_checkpoint",
]
