"""NVMe-resident Engram table shards (engram.table_location = "nvme").

The host table's lookup (host.py: route on the device, gather on the FIFO host worker, rows
all-to-all back) over an NVMe row store (engram/rowstore/nvme_store.py) instead of a host
tensor: each rank's shard rows and their row-sparse optimizer state live in page files under
engram.nvme_dirs, with a host cache of engram.nvme_host_cache_gib in front (split over the
rank's NVMe tables).

- Prefetch (the batch's hash ids, at the start of a step, as for host tables) pins the rows a
  lookup needs in the cache on the worker; the row-sparse optimizer updates them there
  (engram/optim/lazy_adam.py reads and writes the store's columns) and releases the step's pins;
  evictions write pages back. Every worker job runs in program order, so a read sees every
  earlier update: bitwise like device tables.
- Page-in ahead: with the loader read ahead (runner/loop.py), the step routes the next step's
  ids while it runs (`page_in_ahead`, called per lookup by parallelisms/table_prefetch.py
  `page_in_nvme_tables`: the collective, in the same order on every rank) and the
  store starts reading their uncached pages on its I/O pool (the store's `page_in`; the
  exactness argument is engram/rowstore/page_cache.py's docstring); the next step's prefetch
  takes that route instead of routing again.
- The weight parameter keeps its shape and placement but no rows: its local piece is a
  zero-stride view of one element. `to_empty` of the meta-built table creates the store, and
  the layout-independent init (engram/models/init.py) writes its row chunks straight into it:
  the shard is never whole in host memory. (A table materialised otherwise keeps a host shard
  until its first lookup, state dict or load, then `spill` moves the rows into the store, the
  parameter object staying the optimizer's.)
- Checkpoints: the module's state dict reads the weight from the store and the optimizer's reads
  its state columns (`snapshot`), as tensors placed like a host table's, so DCP saves, loads and
  reshards them alike; loading writes them back into the store. The checkpointer streams them
  instead (engram/rowstore/streamed_columns.py): placeholders in the state dicts, and DCP moves
  one row chunk at a time between the store and the files. The page files are scratch and
  are deleted when the process ends; files a killed run left are removed by the next run's
  stores (engram/rowstore/page_files.py).
"""

from __future__ import annotations

import atexit
import itertools
import os
from collections import deque
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from engram.config.table_optimizers import table_optimizer_spec
from engram.rowstore.host_worker import (
    HOST_WORKER,
    attach_row_store,
    mark_host_resident,
    wait_host_work,
)
from engram.rowstore.nvme_store import NvmeRowStore
from engram.rowstore.streamed_columns import ColumnSource, placeholder, source_of, streaming
from engram.runtime.distributed import placed_like
from parallelisms.engram_tables.host import HostShardedEngramTable

__all__ = ["NvmeSettings", "NvmeShardedEngramTable", "remove_page_files"]

_TABLE_NUMBERS = itertools.count()
_STORES: list[tuple[int, NvmeRowStore]] = []  # (pid, store): their files go at exit


@dataclass(frozen=True)
class NvmeSettings:
    """Where NVMe tables keep their pages and how much host cache each table gets."""

    dirs: tuple[str, ...]
    cache_bytes_per_table: int
    table_optimizer: str
    """Its state columns go into the store next to each row (ROW_STATE of its class)."""
    direct_io: bool = True


def _row_state(table_optimizer: str) -> dict[str, bool]:
    import importlib

    module, cls = table_optimizer_spec(table_optimizer).class_path.split(":")
    return dict(getattr(getattr(importlib.import_module(module), cls), "ROW_STATE", {}))


class NvmeShardedEngramTable(HostShardedEngramTable):
    """A row-sharded table whose shard lives in an NVMe row store (see the module docstring)."""

    _engram_nvme: NvmeSettings
    _engram_store: NvmeRowStore | None

    def set_nvme(self, settings: NvmeSettings, label: str = "") -> None:
        """The NVMe settings (once, at sharding time, after set_lookup); `label`: the table's
        name in the model, for errors about its pages."""
        self._engram_nvme = settings
        self._engram_label = label
        self._engram_store = None
        self._engram_ahead: deque = deque()  # (ids, route) paged in for a later prefetch
        mark_host_resident(self.weight, "nvme")
        self._register_state_dict_hook(_weight_from_store)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        """to_empty of a meta shard: no host shard, the rows go straight into a fresh store
        (zeros on disk) and the layout-independent init writes them there chunk by chunk
        (engram/models/init.py); anything else as for host tables."""
        w = self.weight
        local = w.to_local() if isinstance(w, DTensor) else w
        if local.is_meta and getattr(self, "_engram_store", 1) is None:
            hollow = _hollow(local.shape, local.dtype)
            if isinstance(w, DTensor):
                hollow = DTensor.from_local(hollow, w.device_mesh, w.placements, run_check=False,
                                            shape=w.shape, stride=w.stride())  # fmt: skip
            self.weight = torch.nn.Parameter(hollow, requires_grad=w.requires_grad)
            mark_host_resident(self.weight, "nvme")
            self._engram_store = self._new_store(local)
            attach_row_store(self.weight, self._engram_store)
            return self
        super()._apply(fn, recurse)
        mark_host_resident(self.weight, "nvme")
        return self

    def spill(self) -> NvmeRowStore:
        """The store, created on first use from the (initialised) host shard, whose rows it
        takes: the weight's local piece becomes a meta tensor. (A table materialised by
        to_empty has its store from the start.)"""
        if self._engram_store is not None:
            return self._engram_store
        w = self.weight
        local = w.to_local().detach()
        if local.is_meta:
            raise RuntimeError("NVMe Engram table: materialise it (to_empty) before its first use")
        store = self._new_store(local)
        wait_host_work()
        store.load({"weight": local.float()})
        # The parameter stays the optimizer's (same object); its local piece keeps its shape
        # and gives up its memory: a zero-stride view of one element.
        with torch.no_grad():
            w._local_tensor.set_(_hollow(local.shape, local.dtype).untyped_storage(), 0,
                                 local.shape, (0, 0))  # fmt: skip
        attach_row_store(w, store)
        self._engram_store = store
        return store

    def _new_store(self, local: torch.Tensor) -> NvmeRowStore:
        """An empty store (every row zero) for a shard shaped like `local`."""
        s = self._engram_nvme
        if local.dtype != torch.float32:
            raise ValueError(f"NVMe Engram tables keep fp32 rows, got a {local.dtype} table")
        state = _row_state(s.table_optimizer)
        columns = {"weight": local.shape[1]} | {
            k: (local.shape[1] if per_param else 0) for k, per_param in state.items()
        }
        w = self.weight
        row0 = (
            compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)[1][0]
            if isinstance(w, DTensor)
            else 0
        )
        name = f"engram_table{next(_TABLE_NUMBERS)}"
        store = NvmeRowStore(
            local.shape[0], columns, list(s.dirs), s.cache_bytes_per_table, name=name,
            direct=s.direct_io, label=getattr(self, "_engram_label", "") or name, row0=int(row0),
        )  # fmt: skip
        _STORES.append((os.getpid(), store))
        return store

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, *rest):
        """The loaded weight's rows go into the store (the parameter holds none)."""
        key = prefix + "weight"
        if key not in state_dict:
            return super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing, *rest
            )
        store = self.spill()
        wait_host_work()
        value = state_dict[key]
        if source_of(value) is None:  # a placeholder: its rows went (or stay) in the store
            local = value.to_local() if isinstance(value, DTensor) else value
            store.load({"weight": local.detach().to("cpu", torch.float32)})
        rest_of_state = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest_of_state, prefix, local_metadata, strict, missing, *rest)
        if key in missing:
            missing.remove(key)

    def row_store(self) -> NvmeRowStore:
        return self.spill()

    def prefetch(self, ids: torch.Tensor) -> None:
        store = self.spill()
        if not self._engram_prefetched:  # a step's first prefetch: the last step's pins end
            HOST_WORKER.submit(store.release_all)  # (also after a step skipped by the guard)
        super().prefetch(ids)

    def page_in_ahead(self, ids: torch.Tensor) -> None:
        """Route a later step's `ids` now (collective) and start reading their pages; the
        prefetch of these ids takes the route. Every rank must page in the same lookups."""
        store = self.spill()
        route = self._route(ids)
        store.page_in(route.local_idx)
        self._engram_ahead.append((ids, route))

    def _prefetch_route(self, ids: torch.Tensor):
        if not self._engram_ahead:
            return self._route(ids)
        ahead, route = self._engram_ahead.popleft()
        if ahead.shape != ids.shape or not torch.equal(ahead, ids):
            raise RuntimeError(
                "NVMe Engram table: the prefetched ids differ from the ids paged in ahead; "
                "page_in_ahead must see the next step's micro-batches in the order they run"
            )
        return route

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.spill()
        return super().forward(ids)

    def extra_repr(self) -> str:
        return super().extra_repr().replace("host-resident", "NVMe-resident")


def _hollow(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zero-stride view of one element, shaped like the shard: the weight's local piece once
    its rows are in the store."""
    return torch.zeros(1, dtype=dtype).expand(*shape)


def _weight_from_store(module, state_dict, prefix, local_metadata):
    """State-dict hook: the weight's rows read from the store (after queued updates), or
    while a checkpoint streams, a placeholder that reads them in chunks when written."""
    key = prefix + "weight"
    if key in state_dict:
        store = module.spill()
        if streaming():
            state_dict[key] = placeholder(module.weight, ColumnSource(store, "weight"))
            return state_dict
        wait_host_work()
        state_dict[key] = placed_like(module.weight, store.snapshot())
    return state_dict


@atexit.register
def remove_page_files() -> None:
    """Close this process's NVMe row stores and delete their page files (scratch). Runs at
    exit; a launcher whose processes end by os._exit (multiprocessing's forked workers) calls
    it itself. A killed process leaves its files to the next store's sweep
    (engram/rowstore/page_files.py)."""
    mine = [store for pid, store in _STORES if pid == os.getpid()]  # not a forking parent's
    _STORES[:] = [(pid, store) for pid, store in _STORES if pid != os.getpid()]
    for store in mine:
        store.close()
        store.remove_files()
