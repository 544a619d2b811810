"""DCP's file reader for streamed table columns: a row-store table's stored chunks go into its
store a bounded window of rows at a time, every column of a window together.

DCP's own reader loads each stored chunk whole (torch.load) before copying out the part a
rank needs. A checkpoint saved with device or host tables holds a rank's whole shard column as
one chunk, so loading it into NVMe tables would hold that column in host memory at once, and
writing one column at a time into the store would read every page back before the next column
overwrites it. This reader, for the items whose destination is a streamed placeholder
(engram/rowstore/streamed_columns.py):

- finds where each stored chunk's bytes sit in its file (a torch.save archive stores a tensor
  uncompressed: its storage record's offset, and the tensor's dtype, shape and strides from the
  archive's pickle, read by an unpickler that builds only those), and reads rows from there;
- walks the store's rows in windows of at most `CHUNK_BYTES` of records, cut at the store's page
  boundaries, and writes every column of a window at once (`load`), so each page is written
  whole and never read first.

What it cannot do that way (a chunk that is not a plain contiguous tensor, column-split chunks,
columns that cover different rows) goes through the window-free path: a row window of one
column at a time (`ColumnSource.write`), still bounded, reading the pages it partly overwrites.
Everything else in the checkpoint goes through DCP's reader unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.futures import Future
from torch.storage import _get_dtype_from_pickle_storage_type

from engram.checkpoint.dcp_io import RestrictedFileSystemReader
from engram.rowstore import streamed_columns
from engram.rowstore.host_worker import HOST_WORKER
from engram.rowstore.streamed_columns import ColumnSource

__all__ = ["StreamedReader"]


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Rows [dest, dest + n) of a store's column, stored at rows [src, src + n) of a contiguous
    [rows, width] (or [rows]) tensor whose first element is at byte `pos` of `path`."""

    source: ColumnSource
    dest: int
    n: int
    path: str
    pos: int
    src: int
    width: int
    dtype: torch.dtype

    def read(self, a: int, b: int) -> torch.Tensor:
        """Store rows [a, b) of the column (inside [dest, dest + n))."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        row = max(1, self.width) * esize
        buf = torch.empty((b - a) * row, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.pos + (self.src + a - self.dest) * row)
            if f.readinto(memoryview(buf.numpy())) != buf.numel():
                raise OSError(f"{self.path}: a stored table chunk ends early")
        values = buf.view(self.dtype).to(torch.float32)
        return values.view(b - a, self.width) if self.width else values


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a torch.save archive's pickle of one tensor as (storage key, dtype, offset, shape,
    strides); refuses anything else (the caller then takes DCP's path)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, shape, stride, *rest: (*storage, offset, shape, stride)
        if module == "torch" and name.endswith("Storage"):
            return _get_dtype_from_pickle_storage_type(name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        _, dtype, key, _, _ = pid  # ("storage", storage type, key, location, numel)
        return key, dtype


class StreamedReader(RestrictedFileSystemReader):
    """The restricted DCP reader; streamed placeholders' items a row window at a time (see the
    module docstring)."""

    def read_data(self, plan, planner) -> Future[None]:  # type: ignore[override]
        sources: dict[str, ColumnSource] = getattr(planner, "_sources", {})
        plain: dict[int, list[_Rows]] = {}  # per store
        rest = []
        for item in plan.items:
            source = sources.get(item.dest_index.fqn)
            rows = self._rows(item, source) if source and item.type == LoadItemType.TENSOR else None
            if rows is None:  # DCP's way (a placeholder's chunk whole: StreamedLoadPlanner)
                rest.append(item)
            else:
                plain.setdefault(id(source.store), []).append(rows)
        future = super().read_data(dataclasses.replace(plan, items=rest), planner)
        future.wait()
        for parts in plain.values():
            if _same_cover(parts):
                _write_windows(parts)
            else:
                for part in parts:
                    _write_column(part)
        return future

    def _rows(self, item: ReadItem, source: ColumnSource) -> _Rows | None:
        """Where item's rows sit in their file, if a plain read can take them."""
        info = self.storage_data[item.storage_index]
        if info.transform_descriptors or item.dest_offsets[1:] != item.storage_offsets[1:]:
            return None
        path = self.fs.concat_path(self.path, info.relative_path)
        with self.fs.create_stream(path, "rb") as f:
            try:  # torch.save's archive reader (torch.load's own)
                archive = torch._C.PyTorchFileReader(self._slice_file(f, info))
                key, dtype, offset, shape, stride = _LayoutUnpickler(
                    io.BytesIO(archive.get_record("data.pkl"))
                ).load()
                if archive.get_record("byteorder") != b"little":
                    return None
                pos = info.offset + archive.get_record_offset(f"data/{key}")
            except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError):
                return None
        width = source.width
        full = (shape[1:] == (width,) and stride == (width, 1)) if width else len(shape) == 1
        if not full or (len(shape) == 1 and stride != (1,)):
            return None
        esize = torch.empty((), dtype=dtype).element_size()
        return _Rows(
            source, int(item.dest_offsets[0]), int(item.lengths[0]), str(path),
            pos + offset * esize, int(item.storage_offsets[0]), width, dtype,
        )  # fmt: skip


def _same_cover(parts: list[_Rows]) -> bool:
    """Whether every column of the store gets the same rows, without gaps or overlaps."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for p in parts:
        spans.setdefault(p.source.name, []).append((p.dest, p.dest + p.n))
    covers = set()
    for s in spans.values():
        s.sort()
        if any(b != c for (_, b), (c, _) in zip(s, s[1:], strict=False)):
            return False
        covers.add((s[0][0], s[-1][1]))
    store = parts[0].source.store
    return len(covers) == 1 and set(spans) == set(store.columns)


def _window_rows(store) -> tuple[int, int]:
    """(rows of a window, its alignment): at most CHUNK_BYTES of whole records, a multiple of
    the store's rows per page."""
    record = 4 * sum(max(1, w) for w in store.columns.values())
    align = max(1, store.rows_per_page)
    return max(align, streamed_columns.CHUNK_BYTES // record // align * align), align


def _write_windows(parts: list[_Rows]) -> None:
    """Every column of a window of rows at once (whole records: whole pages)."""
    store = parts[0].source.store
    lo = min(p.dest for p in parts)
    hi = max(p.dest + p.n for p in parts)
    window, align = _window_rows(store)
    a = lo
    while a < hi:
        b = min(hi, (a // align) * align + window)
        values = {}
        for name in store.columns:
            pieces = [
                p.read(max(a, p.dest), min(b, p.dest + p.n))
                for p in sorted(parts, key=lambda p: p.dest)
                if p.source.name == name and p.dest < b and p.dest + p.n > a
            ]
            values[name] = torch.cat(pieces)
        HOST_WORKER.submit(store.load, values, None, a).result()
        a = b


def _write_column(part: _Rows) -> None:
    """One item into its column, a window of rows at a time (reads the pages it partly
    overwrites)."""
    window, _ = _window_rows(part.source.store)
    for a in range(part.dest, part.dest + part.n, window):
        b = min(part.dest + part.n, a + window)
        part.source.write(a, part.read(a, b))
