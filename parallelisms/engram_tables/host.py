"""Host-resident Engram table shards (engram.table_location = "host").

Each rank's Shard(0) piece of every table, and its row-sparse optimizer state, stay in host
memory: the table module materialises its shard on the host in `to_empty` (and ignores device
moves), so neither the recipe's `to_empty` / init nor the HF loader moves it. A lookup is the
all-to-all lookup (routing.py, lookup.py) with the owner's gather done on the host:

    ids -> owners (counts + ids all-to-all, on the device)            route_ids
    owner: host gather of the requested rows into a staging buffer    HOST_WORKER (FIFO thread)
    staging -> device (async copy on accelerators), rows all-to-all back, restore order

Backward is unchanged: the owners keep (unique local rows, fp32 summed row gradients) on the
parameter (engram/models/table_grad.py); the row-sparse optimizer copies them to the host and updates
the shard in the same FIFO worker (engram/optim/lazy_adam.py). Exactness: every gather is queued after
every update queued before it, so a lookup reads the rows as updated by the previous step
(bitwise equal to device tables). Prefetch (`prefetch`, driven for a step's lookups under every
layout by parallelisms/table_prefetch.py) runs the id exchange at the start of the step and
queues the gathers, so the lookups find their rows staged; a lookup refuses staged ids other
than its own. Activation checkpointing does not re-run a lookup: the recompute replays the
rows of the original forward (no collective, no gather).

The shard is read through its row store (engram/rowstore/memory.py, the host backend: gathers on
the host worker; accelerator specifics there: page-locked staging, side-stream copies).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engram.models.table_grad import accumulate_row_grad, coalesce_rows
from engram.rowstore.host_worker import mark_host_resident, wait_host_work
from engram.rowstore.interface import RowStore
from engram.rowstore.memory import HostRowStore, on_device
from engram.runtime.distributed import placed_like
from parallelisms.engram_tables.lookup import ShardedEngramTable
from parallelisms.engram_tables.routing import (
    LookupRoute,
    LookupSettings,
    check_ids,
    exchange,
    restore_rows,
    route_grads_to_owners,
    route_ids,
    save_route,
)

__all__ = ["HostShardedEngramTable", "host_table_modules", "lookups_off_queue"]


@dataclass
class _Staged:
    """A prefetched lookup: its ids, route and the pending host gather of the owner's rows."""

    ids: torch.Tensor
    route: LookupRoute
    rows: object  # concurrent.futures.Future[torch.Tensor]


_OFF_QUEUE = [0]  # > 0 inside lookups_off_queue


@contextmanager
def lookups_off_queue() -> Iterator[None]:
    """Lookups inside route and gather now and leave the prefetch queues alone: for forwards
    that are not one of the step's lookups (torch's pipeline metadata forward,
    parallelisms/pipeline.py). Every rank of a table's group must run them alike (collective)."""
    _OFF_QUEUE[0] += 1
    try:
        yield
    finally:
        _OFF_QUEUE[0] -= 1


def _replay_key(ids: torch.Tensor) -> tuple:
    return (ids.data_ptr(), tuple(ids.shape), tuple(ids.stride()), ids._version)


def _in_backward() -> bool:
    """True while autograd runs a backward (an activation-checkpoint recompute runs in it)."""
    return torch._C._current_graph_task_id() != -1


class _HostLookup(torch.autograd.Function):
    """Restores the looked-up rows (already brought back) and, in backward, routes the row
    gradients to their owners, which keep them row-sparse on `table.weight`."""

    @staticmethod
    def forward(ctx, host_weight, rows_back, route, table, key):  # type: ignore[override]
        ctx.table, ctx.key = table, key
        save_route(
            ctx,
            route,
            table.lookup.group,
            table.lookup.grad_scale,
            host_weight.dtype,
            table.lookup.wire_dtype or host_weight.dtype,
            host_weight.shape,
        )
        return restore_rows(route, rows_back)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        ctx.table._engram_replay.pop(ctx.key, None)
        local_idx, grad_recv = route_grads_to_owners(ctx, grad_out)
        if ctx.meta[0] and dist.get_world_size(ctx.meta[2]) == 1:
            # dedup on one rank: the rows are unique and sorted, each summed once already
            accumulate_row_grad(ctx.table.weight, local_idx, grad_recv)
        else:
            accumulate_row_grad(ctx.table.weight, *coalesce_rows(local_idx, grad_recv))
        return None, None, None, None, None


class HostShardedEngramTable(ShardedEngramTable):
    """A row-sharded table whose local shard lives in host memory (see the module docstring)."""

    _engram_prefetched: deque  # _Staged lookups queued by prefetch, in the order they run
    _engram_replay: dict  # _replay_key(ids) -> (route, rows) of a forward, for its AC recompute

    def set_lookup(self, settings: LookupSettings) -> None:
        """The lookup's settings, plus the state a host table carries (once, at sharding time)."""
        super().set_lookup(settings)
        mark_host_resident(self.weight)
        self._engram_prefetched = deque()
        self._engram_replay = {}
        # A state dict (checkpoint save / load) reads or writes the shard: queued updates first.
        self.register_state_dict_pre_hook(lambda *args, **kwargs: wait_host_work())
        self.register_load_state_dict_pre_hook(lambda *args, **kwargs: wait_host_work())

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        """The shard stays on the host: a meta shard is materialised there (to_empty), a
        materialised one is not moved (.to(device), .cuda(), casts)."""
        w = self.weight
        local = w.to_local()
        if local.is_meta:
            host = placed_like(w, torch.empty_like(local, device="cpu"))
            self.weight = nn.Parameter(host, requires_grad=w.requires_grad)  # as Module._apply
            mark_host_resident(self.weight)
        return self

    def prefetch(self, ids: torch.Tensor) -> None:
        """Route `ids` now (collective) and queue the host gather of the owner's rows; the next
        lookup of these ids uses them. Every rank must prefetch the same number of lookups."""
        route = self._prefetch_route(ids)
        future = self.row_store().prefetch(route.local_idx, ids.device)  # behind queued updates
        self._engram_prefetched.append(_Staged(ids, route, future))

    def _prefetch_route(self, ids: torch.Tensor) -> LookupRoute:
        """The route of a prefetch (nvme.py takes one routed a step ahead)."""
        return self._route(ids)

    def row_store(self) -> RowStore:
        """The shard's row store (here the host backend, engram/rowstore/memory.py; nvme.py's
        the NVMe one)."""
        return HostRowStore(self.weight.to_local().detach())

    def _route(self, ids: torch.Tensor) -> LookupRoute:
        check_ids(ids, self.weight.shape[0])
        flat = ids.reshape(-1).to(dtype=torch.long)
        return route_ids(
            flat, self.weight.shape[0], self.weight.to_local().shape[0], self.lookup.group,
            self.lookup.dedup,
        )  # fmt: skip

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        host = self.weight.to_local().detach()  # for shapes: the worker may be updating it
        grad = torch.is_grad_enabled() and self.weight.requires_grad
        key = _replay_key(ids)
        if grad and _in_backward():  # activation-checkpoint recompute: no collective, no gather
            if key not in self._engram_replay:
                raise RuntimeError(
                    "host Engram table: a lookup recomputed in backward has no recorded forward "
                    "(the recompute must see the forward's hash ids)"
                )
            route, rows_back = self._engram_replay[key]
        else:
            route, rows = self._staged_rows(ids)
            wire = self.lookup.wire_dtype or host.dtype
            rows_back = exchange(
                rows.to(wire), route.n_send, route.send_splits, route.recv_splits,
                self.lookup.group,
            ).to(host.dtype)  # fmt: skip
            if grad:
                self._engram_replay[key] = (route, rows_back)
        if not grad:
            out = restore_rows(route, rows_back)
        else:
            # The autograd view of the shard, taken after this lookup's gather (so after every
            # queued update: an in-place update of a view's base forbids it as an input).
            out = _HostLookup.apply(self.weight.to_local(), rows_back, route, self, key)
        return out.view(*ids.shape, host.shape[1])

    def _staged_rows(self, ids: torch.Tensor):
        """(route, owner's rows on the device) from the prefetch queue, else routed and
        gathered now (behind every queued update)."""
        if self._engram_prefetched and not _OFF_QUEUE[0]:
            staged = self._engram_prefetched.popleft()
            if staged.ids.shape != ids.shape or not torch.equal(staged.ids, ids):
                raise RuntimeError(
                    "host Engram table: the lookup's ids differ from the next prefetched ids; "
                    "prefetch_host_tables (parallelisms/table_prefetch.py) must queue the ids "
                    "each lookup sees, in the order the lookups run"
                )
            return staged.route, on_device(staged.rows.result())
        route = self._route(ids)
        future = self.row_store().prefetch(route.local_idx, ids.device, pin=False)
        return route, on_device(future.result())

    def extra_repr(self) -> str:
        return super().extra_repr() + ", host-resident"


def host_table_modules(model: nn.Module) -> list[HostShardedEngramTable]:
    return [m for m in model.modules() if isinstance(m, HostShardedEngramTable)]
