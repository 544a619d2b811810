"""Checkpoints: DCP step folders with a manifest, the config fingerprint, safe reading.

One file per job, lowest first (a file imports only files above it in this list):

- `errors.py`: `CheckpointError`, what every checkpoint problem raises.
- `base_identity.py`: the content digest of the frozen HF backbone a trainable_only checkpoint
  does not hold, and the message when a resume gives another one.
- `collectives.py`: rank, world size, barrier, broadcast, all-gather, raise-if-any-rank-failed;
  each also works without a process group.
- `dcp_io.py`: DCP kept tensors-only: the restricted `.metadata` reader, the load / save
  planners that refuse pickles, `dcp_load`.
- `state.py`: the Stateful wrappers a checkpoint saves (`ModelState`, `OptimizerState`,
  `TrainState`, `RNGState`).
- `table_delta.py`: incremental Engram table checkpoints (checkpoint.table_full_every): a
  delta's per-rank files of touched rows, its DCP part without the tables, the chain record.
- `folder.py`: the step-folder format: names, manifest (write, read, verify, add to), pruning
  one step, fingerprint comparison, and reading one checkpoint in one process
  (`find_checkpoint`, `load_model_checkpoint`: generation and export).
- `deepspeed_folder.py`: a DeepSpeed step folder (recipes/train_deepspeed.py): telling one
  apart, reading DeepSpeed's files weights-only, and reading one into an unsharded model
  (export, generation); imported by name, not part of the API below.
- `save_errors.py`: the message of a failed save (full disk: free and needed bytes).
- `capacity.py`: what checkpoints need of disk (keep_latest_k, incremental tables) and of host
  memory (an async save's staging), the rules the planner and the run's start-up checks share.
- `streamed_dcp.py`: the DCP planners and writer that move NVMe tables' columns one row chunk
  at a time; `streamed_read.py`: the reader that loads them into the store a window of whole
  records at a time, every column together, from where the stored chunks sit in the files.
- `step_folder_ops.py`: `StepFolders`, every path operation on the folder of step folders (list,
  make and remove a save's tmp folder, publish, prune, clean up leftovers).
- `save_plan.py`: a save as a plan (`SavePlan`: the parts it writes, the record it commits);
  the parts (`StreamedDcp`, `StagedDcp`, `FolderStates`, `JsonStates`, `TableRows`,
  `TableChainStart`) and the plans (`full_save`, `table_delta_save`).
- `writer.py`: `CheckpointWriter`, the one writer of every plan: open, write, commit, or finish
  a pending (async) save.
- `resume.py`: the load's steps: candidates, the first intact one, compatibility, the DCP and
  JSON states (a table chain replayed).
- `manager.py`: `CheckpointManager` (when to save and which plan, async save, load, resume).
- `fingerprint.py`: what of the config a checkpoint must agree with to be resumed.
- `run_folder.py`: what makes a folder a run's folder (`run_folder_markers`), for tools that
  must not write into one (the export).

Where a new feature goes: a new file or field in a step folder -> `folder.py` (and `FORMAT` if
old readers would misread it); a new kind of save (another way to write the tables, another
file per save) -> a part and a plan in `save_plan.py`, chosen in `CheckpointManager._plan`,
never a branch in `writer.py`; another storage's path operations -> `step_folder_ops.py`; a new
kind of saved state -> `state.py`; a new rule for what a load may unpickle -> `dcp_io.py`; when
to save, resume or prune -> `manager.py` (the load's checks: `resume.py`); a config key a
resume must agree on -> `fingerprint.py`.

The names below are the package's public API (`from engram.checkpoint import ...`).
"""

from engram.checkpoint.dcp_io import dcp_load
from engram.checkpoint.errors import CheckpointError
from engram.checkpoint.folder import (
    add_to_manifest,
    check_fingerprint,
    file_checksum,
    find_checkpoint,
    fingerprint_mismatches,
    load_model_checkpoint,
    read_fingerprint,
    read_manifest,
    step_folders,
    verify_checkpoint,
)
from engram.checkpoint.manager import CheckpointManager
from engram.checkpoint.state import ModelState, OptimizerState, TrainState

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ModelState",
    "OptimizerState",
    "TrainState",
    "add_to_manifest",
    "check_fingerprint",
    "dcp_load",
    "file_checksum",
    "find_checkpoint",
    "fingerprint_mismatches",
    "load_model_checkpoint",
    "read_fingerprint",
    "read_manifest",
    "step_folders",
    "verify_checkpoint",
]
