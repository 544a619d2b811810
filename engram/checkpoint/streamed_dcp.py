"""DCP planners that move row-store table columns one row chunk at a time.

Inside `streamed_columns()` an NVMe table's state dict holds placeholders (engram/rowstore/
streamed_columns.py). The save planner splits each placeholder's local rows into write items
of at most CHUNK_BYTES (chunks of the same DCP tensor, at their global row offsets: any world
size and table location loads them, as any sharded tensor) and reads a chunk out of the store
only when the writer writes it; the storage writer then writes items strictly one after the
other (no copy-ahead), so the chunk read before is written, and its memory is released, before
the next is read: a save holds one chunk of table data at a time, not a shard. The load planner
reads each stored chunk into a buffer of its size and writes it into the store.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from engram.checkpoint.dcp_io import TensorsOnlyLoadPlanner, TensorsOnlySavePlanner
from engram.checkpoint.streamed_read import StreamedReader
from engram.rowstore import streamed_columns
from engram.rowstore.streamed_columns import ColumnSource, source_of

__all__ = ["StreamedLoadPlanner", "StreamedSavePlanner", "StreamedWriter", "chunk_rows"]


def chunk_rows(width: int) -> int:
    """Rows of one streamed chunk of a column `width` fp32 values wide (0: one per row)."""
    return max(1, streamed_columns.CHUNK_BYTES // (4 * max(1, width)))


def _row_offset(t: torch.Tensor) -> int:
    if not isinstance(t, DTensor):
        return 0
    return int(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1][0])


class StreamedSavePlanner(TensorsOnlySavePlanner):
    """Placeholders become row chunks, each read from its store when written."""

    streams = False
    """Whether this save has placeholders (StreamedWriter then writes without copy-ahead)."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._sources: dict[str, tuple[ColumnSource, int]] = {}
        items = []
        for item in plan.items:
            value = self.state_dict.get(item.index.fqn)
            source = source_of(value)
            if source is None or item.tensor_data is None:
                items.append(item)
                continue
            self._sources[item.index.fqn] = (source, _row_offset(value))
            chunk = item.tensor_data.chunk
            step = chunk_rows(source.width)
            for r0 in range(0, source.rows, step):
                n = min(step, source.rows - r0)
                offsets = torch.Size([chunk.offsets[0] + r0, *chunk.offsets[1:]])
                sizes = torch.Size([n, *chunk.sizes[1:]])
                items.append(dataclasses.replace(
                    item,
                    index=MetadataIndex(item.index.fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=dataclasses.replace(
                        item.tensor_data, chunk=ChunkStorageMetadata(offsets, sizes)
                    ),
                ))  # fmt: skip
        self.streams = bool(self._sources)
        self.plan = dataclasses.replace(plan, items=items)
        self._last: torch.Tensor | None = None
        self.live_bytes = self.peak_bytes = 0
        return self.plan

    def resolve_data(self, write_item):  # type: ignore[override]
        entry = self._sources.get(write_item.index.fqn)
        self._release()
        if entry is None:
            return super().resolve_data(write_item)
        source, offset = entry
        chunk = write_item.tensor_data.chunk
        data = source.read(chunk.offsets[0] - offset, chunk.sizes[0])
        self._last = data
        self.live_bytes += data.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return data

    def _release(self) -> None:
        """The chunk read before was written (the writer resolves an item after writing the
        last): free its memory now (the writer keeps a reference to it until the file ends)."""
        if self._last is not None:
            self.live_bytes -= self._last.nbytes
            self._last.untyped_storage().resize_(0)
            self._last = None


class StreamedWriter(FileSystemWriter):
    """DCP's file writer; for a save with streamed columns one item at a time (the serial
    loader: an item is resolved after the one before is written, never ahead)."""

    def write_data(self, plan, planner):  # type: ignore[override]
        if getattr(planner, "streams", False):
            self.per_thread_copy_ahead = 0
            self.thread_count = 1
        try:
            return super().write_data(plan, planner)
        finally:
            if getattr(planner, "streams", False):
                planner._release()


class StreamedLoadPlanner(TensorsOnlyLoadPlanner):
    """Its reader (streamed_read.py) moves a placeholder's plain stored chunks into the store a
    window of rows at a time, every column together; any other stored chunk of a placeholder is
    read into a buffer of its size and written into the store here."""

    reader = StreamedReader

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        self._sources = {
            fqn: source
            for fqn, value in self.state_dict.items()
            if (source := source_of(value)) is not None
        }
        return plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if read_item.dest_index.fqn in self._sources:
            return torch.empty(tuple(read_item.lengths), dtype=torch.float32)
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        source = self._sources.get(read_item.dest_index.fqn)
        if source is None:
            return super().commit_tensor(read_item, tensor)
        offsets = read_item.dest_offsets
        source.write(int(offsets[0]), tensor, int(offsets[1]) if len(offsets) > 1 else 0)
