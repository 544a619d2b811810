"""The step-folder format: names, manifest, verification, and reading one checkpoint.

Layout under `<run_folder>/<checkpoint.folder>/` (details and rules: docs/checkpointing.md):

    step-<N>/        DCP shards (__<rank>_0.distcp) and .metadata, <name>.rank<k>.json (data
                     loader position, RNG: plain JSON), meta.json, fingerprint.json, and
                     manifest.json (size + CRC-32 of every other file), written last
    step-<N>.tmp/    a save in progress (or one that crashed): removed on the next load
    latest           the newest committed step, for humans and scripts (load scans the folders)

The manifest's CRC-32 detects damage, not forgery: share weights as safetensors
(scripts/export_hf.py). `find_checkpoint` / `load_model_checkpoint` read one checkpoint in one
process (generation, export) with the checks a training resume makes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from engram.checkpoint.base_identity import base_mismatch
from engram.checkpoint.collectives import all_gather_objects, get_rank, get_world_size
from engram.checkpoint.dcp_io import dcp_load
from engram.checkpoint.errors import CheckpointError
from engram.checkpoint.state import ModelState
from engram.checkpoint.table_delta import chain_of, chain_problems, replay_table_weights

logger = logging.getLogger("engram")

FORMAT = "engram-checkpoint/2"
_STEP_RE = re.compile(r"^step-(\d+)$")
STEP_TMP_RE = re.compile(r"^step-(\d+)\.tmp$")
# Every file name this checkpointer (or DCP's FileSystemWriter) creates inside a step folder.
OWN_FILE_RE = re.compile(
    r"^(__\d+_\d+\.distcp|\.metadata|meta\.json|fingerprint\.json|manifest\.json(\.tmp)?"
    r"|[A-Za-z0-9_]+\.rank\d+\.json|table_delta\.rank\d+\.pt)$"
)
META_FILE = "meta.json"
FINGERPRINT_FILE = "fingerprint.json"
MANIFEST_FILE = "manifest.json"
_HASH_CHUNK = 8 << 20


def write_json(path: Path, obj: Any) -> None:
    with path.open("w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
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


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}, so a mismatch names the exact nested key."""
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


# Fingerprint keys that older checkpoints were written without. A checkpoint that lacks one
# cannot be checked on it: that is warned about, not refused, so it still resumes.
_RECORDED_LATER = {
    "frozen_base": "which frozen backbone it was trained on (it was saved with "
    "checkpoint.trainable_only = false, or before base identities were recorded)",
    "lora": "its lora.rank / lora.alpha / lora.target_modules (it was saved before they were "
    "recorded)",
}


def fingerprint_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints (after a JSON round trip). The frozen
    base (base_identity.py) is compared by content, its folder path aside, in one line naming
    the recorded and the given base."""
    saved, current = json.loads(json.dumps(saved)), json.loads(json.dumps(current))
    unverified = [
        what for key, what in _RECORDED_LATER.items() if key in current and key not in saved
    ]
    for key in _RECORDED_LATER:
        if key not in saved:
            current.pop(key, None)
    lines = []
    if "frozen_base" in saved:
        line = base_mismatch(saved.pop("frozen_base"), current.pop("frozen_base", None))
        lines += [line] if line else []
    a, b = _flatten(saved), _flatten(current)
    missing = object()
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            sa = "<absent>" if va is missing else json.dumps(va)
            sb = "<absent>" if vb is missing else json.dumps(vb)
            if len(sa) + len(sb) > 200:  # long lists (table primes): say that, not all of them
                sa, sb = sa[:90] + "...", sb[:90] + "..."
            lines.append(f"{key}: checkpoint {sa}, this run {sb}")
    if unverified and not lines and get_rank() == 0:
        logger.warning(
            "the checkpoint does not record %s: not verified, make sure they are the same",
            "; nor ".join(unverified),
        )
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


def collective_checksums(folder: Path, names: list[str]) -> dict[str, Any]:
    """Every rank checksums a share of the files; all ranks get all results."""
    merged: dict[str, Any] = {}
    for part in all_gather_objects(_checksum_share(folder, names, get_rank(), get_world_size())):
        merged.update(part)
    return merged


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest of checkpoint `path`; CheckpointError naming the file if unusable."""
    file = path / MANIFEST_FILE
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST_FILE} is missing (an incomplete save, or a checkpoint "
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
            all_gather_objects(None)
            problems = list(dict.fromkeys(p for part in all_gather_objects(problems) for p in part))
        return problems
    files: dict[str, dict[str, Any]] = manifest["files"]
    names = sorted(files)
    if collective:
        actual = collective_checksums(path, names)
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
    for required in (".metadata", META_FILE, FINGERPRINT_FILE):
        if required not in files:
            problems.append(f"checkpoint {path}: the manifest does not list {required}")
    if collective:  # every rank decides the same (a rank without the shared folder counts)
        problems = list(dict.fromkeys(p for part in all_gather_objects(problems) for p in part))
    return problems


def add_to_manifest(path: Path, names: Iterable[str]) -> None:
    """List files `names` (relative to checkpoint folder `path`, already written) in its
    manifest with their size and CRC-32, so that a load verifies them like the rest. For a
    derived copy added to a committed checkpoint (a DeepSpeed universal checkpoint); the
    manifest is replaced atomically, one process (no collectives)."""
    manifest = read_manifest(path)
    manifest["files"].update({name: manifest_entry(path / name) for name in names})
    write_manifest(path, manifest)


def manifest_entry(file: Path) -> dict[str, Any]:
    return {"size": file.stat().st_size, "crc32": file_checksum(file)}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Written last and atomically: its presence marks the folder complete."""
    write_json(folder / (MANIFEST_FILE + ".tmp"), manifest)
    os.replace(folder / (MANIFEST_FILE + ".tmp"), folder / MANIFEST_FILE)
    fsync_dir(folder)


def remove_checkpoint(path: Path) -> None:
    """Delete the files the manifest of `path` lists, then the manifest. Anything else
    (a file someone put there) is kept: the folder is renamed `step-<N>.pruned` so it no
    longer looks like a checkpoint, with a warning naming what was kept."""
    files = read_manifest(path)["files"]
    for name in files:
        (path / name).unlink(missing_ok=True)
    (path / MANIFEST_FILE).unlink()
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


def read_fingerprint(path: Path) -> dict[str, Any]:
    """The fingerprint checkpoint folder `path` was written with."""
    try:
        return json.loads((path / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path}: {FINGERPRINT_FILE} cannot be read: {e}"
        ) from None


def check_fingerprint(path: Path, fingerprint: dict[str, Any], ignore: Sequence[str] = ()) -> None:
    """Refuse checkpoint folder `path` if its fingerprint differs from this job's (keys in
    `ignore` aside), naming every difference."""
    saved = {k: v for k, v in read_fingerprint(path).items() if k not in ignore}
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
    manifest = read_manifest(path)
    steps = chain_of(manifest, int(manifest.get("step", 0)))
    with warnings.catch_warnings():  # one process on purpose: DCP's warning says just that
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if len(steps) < 2:
            dcp_load({"model": ModelState(model, keep=keep)}, path, no_dist=True)
            return
        # Tables as deltas (checkpoint.table_full_every): the base, its deltas replayed, then
        # the step's own part (everything but the tables), each step checked first.
        problems = chain_problems(
            path, manifest, lambda s: path.with_name(f"step-{s}"), manifest_crc,
            lambda folder: verify_checkpoint(folder, collective=False),
        )  # fmt: skip
        if problems:
            raise CheckpointError("\n".join(problems))
        folders = [path.with_name(f"step-{s}") for s in steps]
        dcp_load({"model": ModelState(model, keep=keep)}, folders[0], no_dist=True)
        tables = replay_table_weights(model, folders[1:])

        def rest(name: str) -> bool:
            return name not in tables and (keep is None or keep(name))

        dcp_load({"model": ModelState(model, keep=rest)}, path, no_dist=True)


def manifest_crc(folder: Path) -> str | None:
    """CRC-32 of checkpoint `folder`'s manifest; None if it cannot be read."""
    try:
        return file_checksum(folder / MANIFEST_FILE)
    except OSError:
        return None
