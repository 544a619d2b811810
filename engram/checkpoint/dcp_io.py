"""DCP reads and writes that keep a checkpoint tensors-only.

A checkpoint holds tensors only (every scalar state is a 0-d tensor), so nothing in it needs
unpickling beyond DCP's own `.metadata`, which is read with an unpickler that builds only
DCP's metadata classes. Loading a crafted checkpoint therefore runs no code from it. The save
planner refuses a non-tensor item (DCP would pickle it).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from engram.checkpoint.errors import CheckpointError

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


# torch's weights-only refusal wraps its reason in advice (turn weights_only off, allowlist the
# class, file an issue) that is wrong for a checkpoint we refuse on purpose.
_ADVICE = (
    "Weights only load failed",
    "(1)",
    "(2)",
    "Check the documentation",
    "Please file an issue",
)


def unpickler_reason(error: BaseException) -> str:
    """The reason in torch's weights-only UnpicklingError, without its advice: e.g.
    "Unsupported global: GLOBAL __main__.Odd was not an allowed global by default"."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    if "WeightsUnpickler error:" in text:
        reason = text.split("WeightsUnpickler error:", 1)[1]
    else:
        lines = [ln.strip() for ln in text.splitlines()]
        reason = " ".join(ln for ln in lines if ln and not ln.startswith(_ADVICE)) or text
    reason = re.split(r"\.? Please use `torch\.serialization|\n\n", reason.strip(), maxsplit=1)[0]
    return " ".join(reason.split())


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

    reader: type[FileSystemReader] = RestrictedFileSystemReader
    """The storage reader `dcp_load` reads with for this planner."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object this "
                f"checkpointer never writes: refusing to load it ({unpickler_reason(e)})"
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


def dcp_load(
    state: dict[str, Any],
    path: Path,
    no_dist: bool = False,
    planner: TensorsOnlyLoadPlanner | None = None,
) -> None:
    """dcp.load of checkpoint folder `path` without running pickled code from it."""
    planner = planner or TensorsOnlyLoadPlanner()
    dcp.load(state, storage_reader=planner.reader(path), planner=planner, no_dist=no_dist)
