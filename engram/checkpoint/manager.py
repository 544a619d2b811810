"""Distributed checkpointing (torch.distributed.checkpoint) with verified, crash-safe step folders.

Layout under `<run_folder>/<checkpoint.folder>/` (details and rules: docs/checkpointing.md):

    step-<N>/        DCP shards (__<rank>_0.distcp) and .metadata, <name>.rank<k>.json (data
                     loader position, RNG: plain JSON), meta.json, fingerprint.json, and
                     manifest.json (size + CRC-32 of every other file), written last
    step-<N>.tmp/    a save in progress (or one that crashed): removed on the next load
    latest           the newest committed step, for humans and scripts (load scans the folders)

A save writes into `step-<N>.tmp/`; after every rank has finished, rank 0 writes the manifest
(atomically, last) and renames the folder to `step-<N>/`. Load verifies the manifest (every
rank checksums a share of the files) and refuses a damaged or incomplete checkpoint with the
checkpoint, the file and the problem; `checkpoint.on_damaged = "previous"` falls back to the
newest intact one instead. A checkpoint that cannot be read is never overwritten, pruned or
deleted, and the run never silently starts from step 0 while checkpoints exist. Cleanup only
touches folders with this checkpointer's names and file names.

Model and optimizer state are DTensor-aware (FSDP2 shards, row-sharded Engram tables), so they
reload at another world size and layout. JSON states (`per_rank`: the data loader) are stored
per rank; when every rank saved the same state (a global loader position) it loads at any
world size, otherwise the world size must match. RNG states are restored only at the same world
size. Every saved item is a tensor (nothing pickled); `.metadata` is read with an unpickler
restricted to DCP's metadata classes (dcp_load). The manifest's CRC-32 detects damage, not
forgery: share weights as safetensors (scripts/export_hf.py).
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from engram.config import Checkpoint

logger = logging.getLogger("engram")

FORMAT = "engram-checkpoint/2"
_STEP_RE = re.compile(r"^step-(\d+)$")
_STEP_TMP_RE = re.compile(r"^step-(\d+)\.tmp$")
# Every file name this checkpointer (or DCP's FileSystemWriter) creates inside a step folder.
_OWN_FILE_RE = re.compile(
    r"^(__\d+_\d+\.distcp|\.metadata|meta\.json|fingerprint\.json|manifest\.json(\.tmp)?"
    r"|[A-Za-z0-9_]+\.rank\d+\.json)$"
)
_META = "meta.json"
_FINGERPRINT = "fingerprint.json"
_MANIFEST = "manifest.json"
_RNG_KEY = "rng"
_HASH_CHUNK = 8 << 20
# Flattened optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") merges several
# optimizers into one dict and survives a regrouping of parameters.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_PARAM_GROUPS = "param_groups."


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (or written); the message says why and how to fix it."""


# ----------------------------------------------------------------------------- no pickles
# A checkpoint holds tensors only (every scalar state is a 0-d tensor), so nothing in it needs
# unpickling beyond DCP's own `.metadata`, which is read with an unpickler that builds only
# DCP's metadata classes. Loading a crafted checkpoint therefore runs no code from it.

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "StorageMeta",
        "MetadataIndex",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata`: DCP's metadata classes, torch dtypes / Size, paths only."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_CLASSES.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not a DCP metadata class: refusing to unpickle it"
            )
        return super().find_class(module, name)


class RestrictedFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, AttributeError, EOFError, TypeError) as e:
                raise CheckpointError(f"{path} is not a DCP metadata file: {e}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is not a DCP metadata file ({type(metadata)})")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """Reads a non-tensor item (older checkpoints stored the schedule's step as a Python int)
    with torch's weights-only unpickler: plain values load, anything else is refused."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object this "
                f"checkpointer never writes: refusing to load it ({e})"
            ) from None
        # Re-serialised from the weights-only result: DCP's own reader sees plain values only.
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


class TensorsOnlySavePlanner(DefaultSavePlanner):
    """Refuses to save a non-tensor value (DCP would pickle it)."""

    def set_up_planner(
        self, state_dict: Any, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        pickled = sorted(k for k, v in self.state_dict.items() if not isinstance(v, torch.Tensor))
        if pickled:
            raise CheckpointError(
                f"checkpoint items {pickled[:5]} are not tensors (DCP would pickle them): store "
                "scalars as 0-d tensors"
            )


def dcp_load(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """dcp.load of checkpoint folder `path` without running pickled code from it."""
    dcp.load(
        state,
        storage_reader=RestrictedFileSystemReader(path),
        planner=TensorsOnlyLoadPlanner(),
        no_dist=no_dist,
    )


# ----------------------------------------------------------------------------- stateful wrappers


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
        """This rank's parameters and buffers are all finite (local shards only)."""
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


# ----------------------------------------------------------------------------- helpers


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_from_rank0(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _raise_if_any(error: str | None) -> None:
    """Collective: every rank raises the first rank's error, so no rank waits forever."""
    errors = [e for e in _all_gather(error) if e]
    if errors:
        raise CheckpointError(errors[0])


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Persist renames in `path` (a durability hint: some network/FUSE filesystems refuse
    fsync on a directory, and there the rename is all we can do)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        logger.debug("fsync of directory %s not supported: %s", path, e)
    finally:
        os.close(fd)


def file_checksum(path: Path) -> str:
    """CRC-32 (zlib) of a file, hex: ~0.5 s/GB on one core (docs/checkpointing.md)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _is_no_space(exc: BaseException) -> bool:
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        stack += [e.__cause__, e.__context__]
    text = str(exc)
    return "No space left" in text or "Disk quota exceeded" in text


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}, so a mismatch names the exact nested key."""
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def fingerprint_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints (after a JSON round trip)."""
    a = _flatten(json.loads(json.dumps(saved)))
    b = _flatten(json.loads(json.dumps(current)))
    missing = object()
    lines = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            sa = "<absent>" if va is missing else json.dumps(va)
            sb = "<absent>" if vb is missing else json.dumps(vb)
            if len(sa) + len(sb) > 200:  # long lists (table primes): say that, not all of them
                sa, sb = sa[:90] + "...", sb[:90] + "..."
            lines.append(f"{key}: checkpoint {sa}, this run {sb}")
    return lines


# ----------------------------------------------------------------------------- manifest


def _checksum_share(folder: Path, names: list[str], rank: int, world: int) -> dict[str, Any]:
    """{name: (size, crc) or "error text"} for this rank's share of `names`."""
    out: dict[str, Any] = {}
    for name in names[rank::world]:
        try:
            out[name] = (os.path.getsize(folder / name), file_checksum(folder / name))
        except OSError as e:
            out[name] = f"cannot be read ({e.strerror or e})"
    return out


def _collective_checksums(folder: Path, names: list[str]) -> dict[str, Any]:
    """Every rank checksums a share of the files; all ranks get all results."""
    merged: dict[str, Any] = {}
    for part in _all_gather(_checksum_share(folder, names, _rank(), _world_size())):
        merged.update(part)
    return merged


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest of checkpoint `path`; CheckpointError naming the file if unusable."""
    file = path / _MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path}: {_MANIFEST} is missing (an incomplete save, or a checkpoint "
            "written before manifests existed)"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {file} cannot be read: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint {path}: {file} is not a checkpoint manifest")
    return manifest


def verify_checkpoint(path: Path, checksums: bool = True, collective: bool = True) -> list[str]:
    """Problems of checkpoint folder `path` (empty: intact), each naming the file.

    Collective when torch.distributed is initialised and `checksums` is set (every rank hashes a
    share of the files); call it on all ranks then. `checksums=False` checks only presence and
    sizes (cheap: what pruning and listing use). `collective=False`: this process alone."""
    collective = collective and checksums and dist.is_initialized()
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        problems = [str(e)]
        if collective:  # the same collectives as the path below, so ranks stay aligned
            _all_gather(None)
            problems = list(dict.fromkeys(p for part in _all_gather(problems) for p in part))
        return problems
    files: dict[str, dict[str, Any]] = manifest["files"]
    names = sorted(files)
    if collective:
        actual = _collective_checksums(path, names)
    elif checksums:
        actual = _checksum_share(path, names, 0, 1)
    else:
        actual = {}
        for name in names:
            try:
                actual[name] = (os.path.getsize(path / name), files[name]["crc32"])
            except OSError as e:
                actual[name] = f"cannot be read ({e.strerror or e})"
    problems = []
    for name in names:
        want, got = files[name], actual[name]
        where = f"checkpoint {path}: file {name}"
        if isinstance(got, str):
            problems.append(f"{where} is missing" if "No such file" in got else f"{where} {got}")
        elif got[0] != want["size"]:
            problems.append(
                f"{where} has {got[0]} bytes, the manifest says {want['size']} (truncated or replaced)"
            )
        elif got[1] != want["crc32"]:
            problems.append(
                f"{where} has checksum {got[1]}, the manifest says {want['crc32']} (damaged bytes)"
            )
    for required in (".metadata", _META, _FINGERPRINT):
        if required not in files:
            problems.append(f"checkpoint {path}: the manifest does not list {required}")
    if collective:  # every rank decides the same (a rank without the shared folder counts)
        problems = list(dict.fromkeys(p for part in _all_gather(problems) for p in part))
    return problems


def add_to_manifest(path: Path, names: Iterable[str]) -> None:
    """List files `names` (relative to checkpoint folder `path`, already written) in its
    manifest with their size and CRC-32, so that a load verifies them like the rest. For a
    derived copy added to a committed checkpoint (a DeepSpeed universal checkpoint); the
    manifest is replaced atomically, one process (no collectives)."""
    manifest = read_manifest(path)
    manifest["files"].update({name: _manifest_entry(path / name) for name in names})
    _write_manifest(path, manifest)


def _manifest_entry(file: Path) -> dict[str, Any]:
    return {"size": file.stat().st_size, "crc32": file_checksum(file)}


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Written last and atomically: its presence marks the folder complete."""
    _write_json(folder / (_MANIFEST + ".tmp"), manifest)
    os.replace(folder / (_MANIFEST + ".tmp"), folder / _MANIFEST)
    _fsync_dir(folder)


# ----------------------------------------------------------------------------- one step folder


def step_folders(folder: Path) -> list[int]:
    """Steps of every `step-<N>` folder in checkpoint folder `folder` (intact or not), ascending."""
    if not folder.is_dir():
        return []
    return sorted(
        int(m.group(1)) for p in folder.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()
    )


def find_checkpoint(folder: Path, step: int = -1, on_damaged: str = "error") -> Path:
    """The checkpoint to read in one process (generation, export; read-only): `step`, or (-1)
    the newest, verified against its manifest (checksums) as a training resume verifies it.
    A damaged newest one is an error unless `on_damaged = "previous"` (then the newest intact);
    every error names the folder's steps and the damaged ones."""
    steps = step_folders(folder)
    if not steps:
        raise CheckpointError(f"no checkpoint in {folder} (no step-<N> folder)")
    if step >= 0 and step not in steps:
        raise CheckpointError(f"{folder} has no step-{step}; its checkpoints: steps {steps}")
    damaged: list[str] = []
    for candidate in [step] if step >= 0 else steps[::-1]:
        path = folder / f"step-{candidate}"
        problems = verify_checkpoint(path, collective=False)
        if not problems:
            if damaged:
                logger.error("DAMAGED CHECKPOINTS SKIPPED:\n  %s", "\n  ".join(damaged))
            return path
        damaged.append("\n    ".join(problems))
        if on_damaged != "previous":
            break
    raise CheckpointError(
        "refusing to read a damaged or incomplete checkpoint:\n  "
        + "\n  ".join(damaged)
        + f"\n{folder} holds steps {steps}. Fix: restore the files, or choose another step"
        + ("" if step >= 0 else ' (or checkpoint.on_damaged = "previous": the newest intact)')
    )


def check_fingerprint(path: Path, fingerprint: dict[str, Any], ignore: Sequence[str] = ()) -> None:
    """Refuse checkpoint folder `path` if its fingerprint differs from this job's (keys in
    `ignore` aside), naming every difference."""
    try:
        saved = json.loads((path / _FINGERPRINT).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {_FINGERPRINT} cannot be read: {e}") from None
    saved = {k: v for k, v in saved.items() if k not in ignore}
    diffs = fingerprint_mismatches(saved, fingerprint)
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} was written by a different configuration:\n  "
            + "\n  ".join(diffs)
            + "\nFix: pass the config file (and overrides) the run was trained with"
        )


def load_model_checkpoint(
    model: nn.Module,
    path: Path,
    fingerprint: dict[str, Any],
    keep: Callable[[str], bool] | None = None,
) -> None:
    """Load the model state of checkpoint folder `path` (from find_checkpoint) into an unsharded
    `model`, in one process (no collectives; DCP reshards any saved layout). `fingerprint` is
    this job's config_fingerprint; any difference is refused, as on a training resume.
    `keep` (engram.optim.builder.saved_params): a trainable-only checkpoint holds only those entries; the
    rest keeps what `model` holds (engram.hf.load.load_frozen_backbone, read first)."""
    check_fingerprint(path, fingerprint)
    with warnings.catch_warnings():  # one process on purpose: DCP's warning says just that
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load({"model": ModelState(model, keep=keep)}, path, no_dist=True)


# ----------------------------------------------------------------------------- manager


class CheckpointManager:
    """Save every `cfg.interval` steps and at the last step; resume from the newest intact one.

    `states` maps names to Stateful objects (model, optimizer, lr_scheduler, dataloader,
    train_state, ...). Names in `per_rank` are stored as plain JSON per rank (their state_dict()
    must be JSON-serialisable: the data loader); this process's RNG state is added the same way
    when `save_rng` is set. `folder_states` maps names to objects that write and read their own
    files (`save(folder)` / `load(folder)`, collective) in sub-folder `<name>/` of the step folder
    (a DeepSpeed engine's checkpoint): listed in the same manifest and committed with the DCP
    shards. Every method is collective: call it on all ranks.
    """

    def __init__(
        self,
        cfg: Checkpoint,
        run_folder: Path,
        states: dict[str, Any],
        fingerprint: dict[str, Any],
        per_rank: Iterable[str] = ("dataloader",),
        save_rng: bool = True,
        data_meta: dict[str, int] | None = None,
        folder_states: dict[str, Any] | None = None,
    ):
        self.cfg = cfg
        # How the run consumes data ({"global_batch_samples": ..., "seq_len": ...}): stored in
        # meta.json; a resume that changes it is warned about (_warn_data_changed).
        self.data_meta = dict(data_meta or {})
        self.folder = Path(run_folder) / cfg.folder
        self.fingerprint = fingerprint
        self.per_rank = [k for k in per_rank if k in states]
        for name, obj in states.items():
            if not callable(getattr(obj, "state_dict", None)) or not callable(
                getattr(obj, "load_state_dict", None)
            ):
                raise TypeError(
                    f"checkpoint state {name!r} ({type(obj).__name__}) needs state_dict() and "
                    "load_state_dict(): wrap it (ModelState, OptimizerState, TrainState)"
                )
            if name == _RNG_KEY or not re.fullmatch(r"[A-Za-z0-9_]+", name):
                raise ValueError(
                    f"checkpoint state name {name!r} is reserved or not [A-Za-z0-9_]+; rename it"
                )
        self.states = dict(states)
        self.folder_states = dict(folder_states or {})
        for name in self.folder_states:
            if name in self.states or not re.fullmatch(r"[A-Za-z0-9_]+", name):
                raise ValueError(f"folder state name {name!r} is taken or not [A-Za-z0-9_]+")
        self.save_rng = save_rng
        self.rank = _rank()
        self.world_size = _world_size()
        self.last_saved_step: int | None = None
        self.loaded_step: int = 0
        self._pending: tuple[int, Path, Path, Any, float] | None = None
        self._async_group: Any = None
        self._last_size = 0

    # -- paths

    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def _step_folders(self) -> list[int]:
        return step_folders(self.folder)

    def complete_steps(self) -> list[int]:
        """Steps with a committed checkpoint (manifest present, files present with the listed
        sizes; checksums are verified on load), ascending."""
        return [s for s in self._step_folders() if not verify_checkpoint(self.step_dir(s), False)]

    def last_good_checkpoint(self) -> Path | None:
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    # -- state dict assembly

    def _dcp_state(self) -> dict[str, Any]:
        """A fresh dict per call: dcp.load replaces Stateful values in the dict it is given."""
        return {k: v for k, v in self.states.items() if k not in self.per_rank}

    def _json_names(self) -> list[str]:
        return self.per_rank + ([_RNG_KEY] if self.save_rng else [])

    def _json_state(self, name: str) -> Any:
        return RNGState() if name == _RNG_KEY else self.states[name]

    # -- save

    def should_save(self, step: int, last_step: bool = False) -> bool:
        return self.cfg.enable and step > 0 and (last_step or step % self.cfg.interval == 0)

    def maybe_save(self, step: int, last_step: bool = False, finite: bool = True) -> bool:
        """Save at every `interval` steps and at the last step; True if a checkpoint was written
        (or, with checkpoint.async_mode = "async", started; the last step's save is synchronous).

        `finite=False` (the step's update was skipped as non-finite): no save, so a save never
        prunes an older checkpoint because of such a step, and every checkpoint is one of a
        finite step (what the error messages call the last good checkpoint)."""
        if not self.should_save(step, last_step):
            return False
        if not finite:
            if self.rank == 0:
                logger.warning(
                    "step %d was skipped as non-finite: not saving a checkpoint at it (the older "
                    "checkpoints are kept)",
                    step,
                )
            return False
        self.save(step, blocking=last_step or self.cfg.async_mode != "async")
        return True

    def _check_finite(self, step: int) -> None:
        local_ok = all(s.all_finite() for s in self.states.values() if isinstance(s, ModelState))
        if not all(_all_gather(local_ok)):
            good = self.last_good_checkpoint()
            raise CheckpointError(
                f"refusing to save step {step}: the model holds non-finite values (NaN/inf). "
                f"The last good checkpoint is {good or 'none'}; resume from it with a lower "
                "optimizer.lr or a clipping norm (training.max_norm)"
            )

    def save(self, step: int, blocking: bool = True) -> Path:
        """Write checkpoint `step`. `blocking=False`: DCP writes in a background thread and the
        checkpoint is committed by the next save() or wait(); a crash before that leaves only a
        `step-<N>.tmp/` folder (not a checkpoint) and the previous checkpoints intact."""
        begin = time.perf_counter()
        self._check_finite(step)
        self.wait()  # the previous (async) save is committed before a new one starts
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        try:
            if not self._save_into(step, tmp, final, blocking):
                logger.info(
                    "checkpoint step-%d staged in %.1f s; writing in the background",
                    step,
                    time.perf_counter() - begin,
                )
                return final
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise self._save_failed(step, tmp, e) from e
        if self.rank == 0:
            logger.info(
                "saved checkpoint %s (%.1f MiB) in %.1f s",
                final,
                self._last_size / 2**20,
                time.perf_counter() - begin,
            )
        self.last_saved_step = step
        return final

    def wait(self) -> None:
        """Finish a pending async save: wait for DCP, then verify and commit it (collective)."""
        if self._pending is None:
            return
        step, tmp, final, future, begin = self._pending
        self._pending = None
        error = None
        try:
            future.result()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error = self._describe_save_error(step, tmp, e)
        try:
            _raise_if_any(error)
            self._commit_collective(step, tmp, final)
        except CheckpointError:
            if self.rank == 0 and tmp.is_dir():
                try:
                    self._remove_own_tmp(tmp)
                except (OSError, CheckpointError) as cleanup:
                    logger.warning("could not remove partial checkpoint %s: %s", tmp, cleanup)
            raise
        if self.rank == 0:
            logger.info(
                "committed checkpoint %s (%.1f MiB), %.1f s after it was started",
                final,
                self._last_size / 2**20,
                time.perf_counter() - begin,
            )
        self.last_saved_step = step

    def _save_into(self, step: int, tmp: Path, final: Path, blocking: bool = True) -> bool:
        """Returns True when the checkpoint is committed, False when an async save is pending."""
        error = None
        if self.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # left by a crashed save of this step
                    self._remove_own_tmp(tmp)
                tmp.mkdir()
            except (OSError, CheckpointError) as e:
                error = self._describe_save_error(step, tmp, e)
        _raise_if_any(error)
        future = None
        if blocking:
            dcp.save(self._dcp_state(), checkpoint_id=str(tmp), planner=TensorsOnlySavePlanner())
        else:
            if self._async_group is None and dist.is_initialized():
                # Its own gloo group: the background thread's collectives must not interleave
                # with the training loop's on the default group.
                self._async_group = dist.new_group(backend="gloo")
            response = dcp.async_save(
                self._dcp_state(),
                checkpoint_id=str(tmp),
                process_group=self._async_group,
                planner=TensorsOnlySavePlanner(),
            )
            future = getattr(response, "upload_completion", response)
        for name, obj in self.folder_states.items():
            obj.save(tmp / name)
        error = None
        try:
            for name in self._json_names():
                state = self._json_state(name).state_dict()
                _write_json(tmp / f"{name}.rank{self.rank}.json", state)
        except OSError as e:
            error = self._describe_save_error(step, tmp, e)
        except TypeError as e:
            error = f"checkpoint state {name!r} is not JSON-serialisable: {e}"
        _raise_if_any(error)  # also the barrier: every rank's files are on disk
        if future is not None:
            self._pending = (step, tmp, final, future, time.perf_counter())
            return False
        self._commit_collective(step, tmp, final)
        return True

    def _commit_collective(self, step: int, tmp: Path, final: Path) -> None:
        names = _broadcast_from_rank0(
            sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
            if self.rank == 0
            else None
        )
        checksums = _collective_checksums(tmp, names)
        error = None
        if self.rank == 0:
            try:
                self._commit(step, tmp, final, checksums)
            except (OSError, CheckpointError) as e:
                error = self._describe_save_error(step, tmp, e)
        _raise_if_any(error)

    def _space_left(self) -> tuple[int | None, int | None]:
        """(bytes free on the checkpoint folder's filesystem, bytes the newest committed
        checkpoint takes: about what a save needs); None where unknown."""
        where = self.folder if self.folder.is_dir() else self.folder.parent
        try:
            free: int | None = shutil.disk_usage(where).free
        except OSError:
            free = None
        need = None
        for step in reversed(self._step_folders()):
            try:
                need = sum(f["size"] for f in read_manifest(self.step_dir(step))["files"].values())
                break
            except (CheckpointError, KeyError, TypeError):
                continue
        return free, need

    def _describe_save_error(self, step: int, tmp: Path, e: BaseException) -> str:
        # A full disk often surfaces as another error (torch's zip writer: "file write
        # failed"): the free space decides, not only the exception's errno.
        free, need = self._space_left()
        full = free is not None and free < (need if need is not None else 1 << 20)
        if _is_no_space(e) or full:
            sizes = f"{_mib(free)} free" if free is not None else "free space unknown"
            if need is not None:
                sizes += f", the previous checkpoint took {_mib(need)}"
            first = (str(e).strip().splitlines() or [""])[0][:160]
            what = f"no space left on the device ({sizes}; {type(e).__name__}: {first})"
        else:
            what = f"{type(e).__name__}: {e}"
        return (
            f"saving checkpoint step-{step} into {tmp} failed: {what}. Previous checkpoints "
            f"in {self.folder} are untouched. Free space (or lower checkpoint.keep_latest_k), "
            "or point job.dump_folder / checkpoint.folder at a writable filesystem"
        )

    def _save_failed(self, step: int, tmp: Path, e: BaseException) -> CheckpointError:
        """A save raised (on any rank): remove our partial folder, report the path and why."""
        if self.rank == 0 and tmp.is_dir():
            try:
                self._remove_own_tmp(tmp)
            except (OSError, CheckpointError) as cleanup:
                logger.warning("could not remove partial checkpoint %s: %s", tmp, cleanup)
        return CheckpointError(self._describe_save_error(step, tmp, e))

    def _commit(self, step: int, tmp: Path, final: Path, checksums: dict[str, Any]) -> None:
        meta = {
            "format": FORMAT,
            "step": step,
            "world_size": self.world_size,
            "json_states": self._json_names(),
            "states": sorted([*self.states, *self.folder_states]),
            "torch_version": torch.__version__,
            "time": time.time(),
            "data": self.data_meta,
        }
        _write_json(tmp / _FINGERPRINT, self.fingerprint)
        _write_json(tmp / _META, meta)
        files = {}
        for name, got in checksums.items():
            if isinstance(got, str):
                raise OSError(f"{tmp / name} {got}")
            files[name] = {"size": got[0], "crc32": got[1]}
        for name in (_FINGERPRINT, _META):
            files[name] = _manifest_entry(tmp / name)
        self._last_size = sum(f["size"] for f in files.values())
        _write_manifest(tmp, {"format": FORMAT, "step": step, "files": files})
        if final.exists():
            problems = verify_checkpoint(final, collective=False)
            if problems:
                # Never overwrite what could not be read: keep it aside for inspection.
                aside = final.with_name(f"{final.name}.unreadable-{int(time.time())}")
                logger.error(
                    "checkpoint %s could not be read (%s); moved to %s, not overwritten",
                    final,
                    problems[0],
                    aside,
                )
                os.rename(final, aside)
                os.rename(tmp, final)
            else:
                # Re-saving a step (resumed from an older checkpoint): the new history wins.
                logger.warning("replacing existing checkpoint %s", final)
                old = final.with_name(final.name + ".tmp.replaced")
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        latest_tmp = self.folder / "latest.tmp"
        latest_tmp.write_text(f"{step}\n")
        os.replace(latest_tmp, self.folder / "latest")
        _fsync_dir(self.folder)
        self._prune()

    def _prune(self) -> None:
        """Remove intact checkpoints beyond the newest keep_latest_k; never damaged ones."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        for step in self.complete_steps()[:-k]:
            self._remove_checkpoint(self.step_dir(step))
            logger.info("pruned checkpoint %s (keep_latest_k=%d)", self.step_dir(step), k)

    def _remove_checkpoint(self, path: Path) -> None:
        """Delete the files the manifest of `path` lists, then the manifest. Anything else
        (a file someone put there) is kept: the folder is renamed `step-<N>.pruned` so it no
        longer looks like a checkpoint, with a warning naming what was kept."""
        files = read_manifest(path)["files"]
        for name in files:
            (path / name).unlink(missing_ok=True)
        (path / _MANIFEST).unlink()
        # Sub-folders of listed files (a folder state's), deepest first, once they are empty.
        parents = {q for name in files for q in Path(name).parents if q != Path(".")}
        for sub in sorted(parents, key=lambda q: len(q.parts), reverse=True):
            if (path / sub).is_dir() and not any((path / sub).iterdir()):
                (path / sub).rmdir()
        kept = sorted(p.name for p in path.iterdir())
        if not kept:
            path.rmdir()
            return
        aside = path.with_name(f"{path.name}.pruned")
        if aside.exists():
            aside = path.with_name(f"{path.name}.pruned-{int(time.time())}")
        os.rename(path, aside)
        logger.warning(
            "pruning %s: kept files the checkpointer did not write (%s) in %s",
            path,
            ", ".join(kept[:5]),
            aside,
        )

    # -- load

    def _remove_own_tmp(self, path: Path) -> None:
        """Remove a `step-<N>.tmp` folder only if every file in it has one of our names."""
        foreign = [
            p.name
            for p in path.iterdir()
            if not (p.is_file() and _OWN_FILE_RE.match(p.name))
            and not (p.is_dir() and p.name in self.folder_states)
        ]
        if foreign:
            raise CheckpointError(
                f"{path} looks like an interrupted save but holds files this checkpointer does "
                f"not write ({', '.join(sorted(foreign)[:5])}): not removing it. Move it away"
            )
        shutil.rmtree(path)

    def _clean_tmp(self) -> None:
        """Remove leftovers of interrupted saves: only our own names (step-<N>.tmp, latest.tmp)."""
        if not self.folder.is_dir():
            return
        for p in self.folder.iterdir():
            if _STEP_TMP_RE.match(p.name) and p.is_dir():
                try:
                    self._remove_own_tmp(p)
                    logger.warning("removed leftover of an interrupted save: %s", p)
                except CheckpointError as e:
                    logger.warning("%s", e)
            elif p.name == "latest.tmp" and p.is_file():
                p.unlink()

    def _candidates(self) -> list[int]:
        """Rank 0: the steps to try, newest first; [] for a fresh start."""
        self._clean_tmp()
        steps = self._step_folders()
        if self.cfg.load_step == 0:
            if steps:
                logger.warning(
                    "checkpoint.load_step = 0: starting from step 0 although %s holds "
                    "checkpoints %s (they are kept)",
                    self.folder,
                    steps,
                )
            return []
        if self.cfg.load_step > 0:
            if self.cfg.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step={self.cfg.load_step} but {self.folder} has no "
                    f"step-{self.cfg.load_step}; checkpoints: {steps or 'none'}. Set "
                    "checkpoint.load_step to one of them, -1 for the newest, or 0 to start fresh"
                )
            return [self.cfg.load_step]
        return steps[::-1]

    def load(self) -> int:
        """Resume from `cfg.load_step` or the newest intact checkpoint; returns its step.

        Returns 0 (states untouched) when checkpointing is disabled, there is no checkpoint
        yet, or `checkpoint.load_step = 0`."""
        if not self.cfg.enable:
            return 0
        choice: list[int] | str = []
        if self.rank == 0:
            try:
                choice = self._candidates()
            except CheckpointError as e:
                choice = str(e)  # tell the other ranks, so nobody waits forever
        choice = _broadcast_from_rank0(choice)
        if isinstance(choice, str):
            raise CheckpointError(choice)
        if not choice:
            logger.info("no checkpoint to load in %s: starting from step 0", self.folder)
            return 0
        damaged: list[str] = []
        for step in choice:
            path = self.step_dir(step)
            problems = verify_checkpoint(path)
            if not problems:
                break
            damaged.append(f"{path}:\n    " + "\n    ".join(problems))
            if self.cfg.on_damaged == "error" or self.cfg.load_step > 0:
                raise CheckpointError(
                    f"checkpoint {path} is damaged or incomplete:\n    "
                    + "\n    ".join(problems)
                    + "\nNothing was changed in the folder. Fix: restore the files, set "
                    'checkpoint.on_damaged = "previous" to resume from the newest intact '
                    "checkpoint, or checkpoint.load_step to another step (0: start fresh)"
                )
            logger.error(
                "CHECKPOINT %s IS DAMAGED, falling back to an older one "
                "(checkpoint.on_damaged = previous):\n    %s",
                path,
                "\n    ".join(problems),
            )
        else:
            raise CheckpointError(
                f"{self.folder} holds checkpoints but none is intact:\n  "
                + "\n  ".join(damaged)
                + "\nRefusing to start from step 0 over them. Fix: restore the files, or set "
                "checkpoint.load_step = 0 to start fresh (the damaged checkpoints are kept), or "
                "use another checkpoint.folder"
            )
        meta = self._check_compatible(path)
        self._warn_data_changed(path, meta.get("data", {}))
        begin = time.perf_counter()
        for name, obj in self.folder_states.items():  # first: they refuse what they cannot load
            obj.load(path / name)
        try:
            dcp_load(self._dcp_state(), path)
        except (Exception, CheckpointException) as e:  # name the checkpoint, not just DCP
            raise CheckpointError(
                f"checkpoint {path} passed its manifest check but DCP could not load it into "
                f"this run: {type(e).__name__}: {e}"
            ) from e
        self._load_json_states(path, meta)
        _barrier()
        logger.info("loaded checkpoint %s in %.1f s", path, time.perf_counter() - begin)
        self.loaded_step = step
        return step

    def _load_json_states(self, path: Path, meta: dict[str, Any]) -> None:
        saved_world = int(meta["world_size"])
        for name in self._json_names():
            states = []
            for k in range(saved_world):
                try:
                    states.append(json.loads((path / f"{name}.rank{k}.json").read_text()))
                except (OSError, ValueError) as e:
                    raise CheckpointError(
                        f"checkpoint {path}: {name}.rank{k}.json cannot be read: {e}"
                    ) from None
            if all(s == states[0] for s in states):
                self._json_state(name).load_state_dict(states[0])  # global: any world size
            elif saved_world == self.world_size:
                self._json_state(name).load_state_dict(states[self.rank])
            elif name == _RNG_KEY:
                if self.rank == 0:
                    logger.warning(
                        "checkpoint %s was saved by %d ranks, this run has %d: the per-rank RNG "
                        "states are not restored",
                        path,
                        saved_world,
                        self.world_size,
                    )
            else:
                raise CheckpointError(
                    f"checkpoint {path} was saved by {saved_world} ranks but this run has "
                    f"{self.world_size}, and its {name!r} state differs between ranks (a "
                    f"per-rank position), so it cannot be resharded. Resume with {saved_world} "
                    "ranks, or use a loader whose state is global (the same on every rank)"
                )

    def _warn_data_changed(self, path: Path, saved: dict[str, Any]) -> None:
        changed = {
            k: (saved[k], v) for k, v in self.data_meta.items() if k in saved and saved[k] != v
        }
        if changed and self.rank == 0:
            logger.warning(
                "resuming %s with another data consumption per step: %s. The data continues "
                "from the saved position, but every step from here takes the new amount, so "
                "the steps do not see the samples the original run's steps would have, "
                "tokens_seen counts the new size and the lr schedule (by step) spreads over a "
                "different number of samples. Resume with the saved values to continue the "
                "original data order",
                path,
                ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()),
            )

    def _check_compatible(self, path: Path) -> dict[str, Any]:
        try:
            meta = json.loads((path / _META).read_text())
            saved_fp = json.loads((path / _FINGERPRINT).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"rank {self.rank} cannot read {getattr(e, 'filename', None) or path}: {e}. "
                "On several nodes the checkpoint folder (job.dump_folder) must be on a "
                "filesystem shared by all nodes"
            ) from None
        fix = (
            "Nothing was changed in the run folder. Fix: run with the config this checkpoint "
            "was written with, or start a fresh run (a new job.run_name, or another "
            "job.dump_folder)."
        )
        diffs = fingerprint_mismatches(saved_fp, self.fingerprint)
        if diffs:
            raise CheckpointError(
                f"checkpoint {path} was written by a different configuration:\n  "
                + "\n  ".join(diffs)
                + f"\n{fix}"
            )
        missing = sorted((set(self.states) | set(self.folder_states)) - set(meta["states"]))
        if missing:
            raise CheckpointError(
                f"checkpoint {path} has no state for {missing} (it holds {meta['states']}). {fix}"
            )
        lacking = sorted(set(self._json_names()) - set(meta.get("json_states", [])))
        if lacking:
            raise CheckpointError(f"checkpoint {path} has no state for {lacking}. {fix}")
        return meta
