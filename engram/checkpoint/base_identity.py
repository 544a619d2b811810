"""The identity of a frozen backbone that a `checkpoint.trainable_only` checkpoint does not hold.

Such a checkpoint stores only what trained (adapters, Engram) on top of a backbone read from
`model.hf_checkpoint` (or, without one, the `job.seed` init), so that backbone is part of what
its weights mean. The folder's name is not its identity (a copy elsewhere is the same base; a
re-download of another revision into the same path is not), so the record is a content digest:

    sha256 over the safetensors index (when there is one) and, for every `*.safetensors` file in
    name order: its name, its header (every tensor's name, dtype, shape and offsets) and 4
    windows of 64 KiB of its tensor bytes (start, end and two evenly between)

About 256 KiB read per file (17 files, ~4 MiB, for a 32B model), so every rank computes it at
start-up. Another model, revision or fine-tune (which changes every weight) is told apart; an
edit confined to bytes outside the windows is not (a full checksum of 65 GB would take about a
minute per rank). The folder path is recorded for the error message only, never compared.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engram.checkpoint.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
_WINDOWS = 4
_WINDOW_BYTES = 64 << 10


def _file_digest(path: Path, h: Any) -> tuple[int, int]:
    """Feed `path`'s header and sampled tensor bytes into `h`; returns (tensors, data bytes)."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(head, "little")
        header = f.read(n)
        try:
            tensors = len([k for k in json.loads(header) if k != "__metadata__"])
        except ValueError as e:
            raise CheckpointError(f"{path} has no readable safetensors header: {e}") from None
        h.update(path.name.encode() + b"\0" + head + header)
        start = 8 + n
        size = path.stat().st_size - start
        if size <= _WINDOWS * _WINDOW_BYTES:
            offsets = [0]
            length = size
        else:
            step = (size - _WINDOW_BYTES) // (_WINDOWS - 1)
            offsets = [i * step for i in range(_WINDOWS)]
            length = _WINDOW_BYTES
        for offset in offsets:
            f.seek(start + offset)
            h.update(f.read(length))
    return tensors, size


def base_identity(folder: str | Path) -> dict[str, Any]:
    """{"sha256", "files", "tensors", "bytes", "folder"} of the HF folder `folder`."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise CheckpointError(
            f"model.hf_checkpoint {folder} holds no *.safetensors files (or does not exist): "
            "set it to the Hugging Face folder the frozen backbone is read from"
        )
    h = hashlib.sha256()
    if (folder / INDEX_FILE).is_file():
        h.update((folder / INDEX_FILE).read_bytes())
    tensors = size = 0
    for path in files:
        t, s = _file_digest(path, h)
        tensors, size = tensors + t, size + s
    return {
        "sha256": h.hexdigest(),
        "files": len(files),
        "tensors": tensors,
        "bytes": size,
        "folder": str(folder.resolve()),
    }


def frozen_base(hf_checkpoint: str, seed: int) -> dict[str, Any]:
    """What a trainable_only checkpoint's backbone is: the HF folder's identity, or the seed of
    the random init when there is no folder."""
    return base_identity(hf_checkpoint) if hf_checkpoint else {"init_seed": seed}


def describe_base(entry: dict[str, Any]) -> str:
    if "sha256" in entry:
        return (
            f"model.hf_checkpoint {entry.get('folder')} (sha256 {entry['sha256'][:16]}, "
            f"{entry['tensors']} tensors in {entry['files']} files, {entry['bytes']:,} bytes)"
        )
    return f"no model.hf_checkpoint (the random init of job.seed {entry.get('init_seed')})"


def base_mismatch(saved: dict[str, Any], current: dict[str, Any] | None) -> str | None:
    """One line naming the recorded and the given base when they differ (the folder path
    aside), else None. `current` None: this run has checkpoint.trainable_only = false."""
    if current is None:
        return (
            "frozen_base: this checkpoint.trainable_only checkpoint holds no backbone (it was "
            f"trained on {describe_base(saved)}), but this run sets checkpoint.trainable_only = "
            "false and would read the backbone from it. Fix: set checkpoint.trainable_only = true"
        )
    if {k: v for k, v in saved.items() if k != "folder"} == {
        k: v for k, v in current.items() if k != "folder"
    }:
        return None
    fix = (
        "set model.hf_checkpoint to that base (the same files; another path is fine)"
        if "sha256" in saved
        else f"remove model.hf_checkpoint and set job.seed = {saved.get('init_seed')}"
    )
    return (
        "frozen_base: this checkpoint.trainable_only checkpoint holds no backbone; it was "
        f"trained on {describe_base(saved)}, but this run's backbone is {describe_base(current)}. "
        f"Fix: {fix}"
    )
