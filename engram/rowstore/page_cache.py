"""The NVMe row store's page cache: which page is in which slot of the host cache, least
recently used first out, dirty pages written back when evicted, pins, and pages read ahead of
their step.

Cache. `cache_bytes` of page slots (page_io.py owns them), least recently used first out; a
dirty page is written back when it is evicted (and by `flush`). `pin(pages)` loads pages and
holds them until `release(pages)`: a step's rows stay in host memory from prefetch to their last
use, so reads and updates never wait on the disk mid-step. A pin that cannot fit the cache is
refused, naming the setting to raise. The cache is not thread-safe: the tables use it from the
one FIFO host worker (engram/rowstore/host_worker.py).

Its state is a few tensors (slot of each page, page, last use, dirty, pins and in-flight read
of each slot) and a short list of in-flight I/O tasks, so a step's thousands of pages cost a
few tensor ops, not Python per page: the host worker holds the GIL, which the step's main thread
needs, for as little as it can.

Page-in ahead. `page_in(pages)` (queued on the worker while step N computes, with step N+1's
pages) starts reading the uncached pages into free or evicted slots on the I/O pool and returns
at once; the reads (and the write-backs of the dirty pages they evict) overlap the step. Why the
rows a step sees stay exactly those of the device tier:

- Every cache-state mutation (which page is in which slot, dirty, pinned, loading, being
  written back) happens on the one FIFO worker, in program order with every read and update;
  the I/O threads only move bytes between a slot they were given and the file.
- A page missing from the cache has its latest value on disk, or on its way there: an evicted
  dirty page stays in its task's written pages until the write-back completes, and anything that
  needs it again (a load, a page-in, a read-out) waits for that task first, so it never reads
  stale bytes.
- A page being read is mapped to its slot but the slot is `loading`: nothing evicts it, writes
  it or reads it; the first load, pin, read or write of the page waits for its read first. Its
  disk value is final: it was not cached, so no update could change it, and no update can run
  on it before its read completes.
- A page-in evicts only unpinned pages that it does not itself page in: the pages of step N
  (pinned by step N's prefetch, which is queued before the page-in) stay, and its victims'
  contents are final when chosen (every earlier job has run; a later job that wants the page
  loads it again, after the write-back). Evicting a page step N updates without a pin would
  cost a re-read, not a wrong value.
- A page-in is only a hint: it pages in what the free and evictable slots allow, and never
  fails for room; the rest is paged in when the step's pins end (`release_all`, after its
  update: those pages can be evicted then), and the next step's pin loads whatever is still
  missing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engram.rowstore.page_io import PageIO

__all__ = ["PageCache"]

_NONE = torch.empty(0, dtype=torch.long)


@dataclass
class _Task:
    """A page-in on the I/O pool: writes `written` back, then reads into `slots`."""

    future: Future
    slots: torch.Tensor  # the slots it reads into (their pages are mapped, `loading`)
    written: torch.Tensor  # the evicted pages it writes back


class PageCache:
    """`io.slots` as a cache of the store's pages (see the module docstring). Pages and slots
    are int64 tensors of unique page numbers."""

    def __init__(self, io: PageIO, pages: int, cache_pages: int) -> None:
        self.io, self.cache_pages = io, cache_pages
        self.slot_of = torch.full((pages,), -1, dtype=torch.int32)  # page -> slot, or -1
        self.page_of = torch.full((cache_pages,), -1, dtype=torch.long)  # slot -> page, or -1
        self.last_use = torch.zeros(cache_pages, dtype=torch.long)  # the clock at its last use
        self.dirty = torch.zeros(cache_pages, dtype=torch.bool)
        self.pins = torch.zeros(cache_pages, dtype=torch.int32)
        self.loading = torch.zeros(cache_pages, dtype=torch.long)  # its page-in task, or 0
        self.writing = torch.zeros(pages, dtype=torch.bool)  # evicted, its write-back in flight
        self.tasks: dict[int, _Task] = {}
        self._clock = 0
        self._task_ids = 0
        self._ahead = _NONE  # the pages of the last page_in (kept by its evictions)
        self._ahead_rest = _NONE  # those it had no room for yet
        self.paged_in = 0  # pages read ahead by page_in
        self.page_in_waits = 0  # page-ins still in flight when a load needed the page
        self.page_in_wait_s = 0.0  # seconds loads waited for those
        self.lookup_pages = self.lookup_hits = 0  # pages lookups pinned; of them, resident

    # -- what the store and tests ask -------------------------------------------------------
    def cached(self) -> torch.Tensor:
        """The pages with a slot (their read may still be in flight)."""
        return self.page_of[self.page_of >= 0]

    def pinned(self, pages: torch.Tensor) -> torch.Tensor:
        """Whether each of `pages` is cached and pinned."""
        slots = self.slot_of[pages]
        return (slots >= 0) & (self.pins[slots.clamp(min=0)] > 0)

    def in_flight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages being written back, pages being read) by page-ins not settled yet."""
        written = [t.written for t in self.tasks.values()]
        read = [self.page_of[t.slots] for t in self.tasks.values()]
        return torch.cat([_NONE, *written]), torch.cat([_NONE, *read])

    # -- in-flight page-ins ------------------------------------------------------------------
    def settle(self, ids=None) -> None:
        """Wait for the page-in tasks `ids` (default all; their errors raise here); the pages
        they read become cached (most recently used)."""
        for i in list(self.tasks) if ids is None else ids:
            task = self.tasks.pop(i)
            waited, t0 = len(task.slots) and not task.future.done(), time.perf_counter()
            task.future.result()
            if waited:
                self.page_in_waits += 1
                self.page_in_wait_s += time.perf_counter() - t0
            self.loading[task.slots] = 0
            self.writing[task.written] = False
            self.last_use[task.slots] = self._clock

    def _reap(self) -> None:
        """Settle the page-in tasks that have finished."""
        self.settle([i for i, t in self.tasks.items() if t.future.done()])

    def _wait_for(self, pages: torch.Tensor) -> None:
        """Settle the tasks that read or write back any of `pages`."""
        if not self.tasks:
            return
        self._reap()
        slots = self.slot_of[pages]
        ids = set(torch.unique(self.loading[slots[slots >= 0]]).tolist()) - {0}
        if bool(self.writing[pages].any()):  # (the tasks that write pages back: few)
            ids |= {i for i, t in self.tasks.items() if len(t.written)}
        self.settle(sorted(ids))

    # -- slots ------------------------------------------------------------------------------
    def _free(self) -> torch.Tensor:
        return torch.nonzero(self.page_of < 0).view(-1)

    def _victims(self, need: int, keep: torch.Tensor) -> torch.Tensor:
        """Up to `need` slots to evict, least recently used first: never a pinned or loading
        slot, nor one of the slots `keep`."""
        if need <= 0:
            return _NONE
        ok = (self.page_of >= 0) & (self.pins == 0) & (self.loading == 0)
        ok[keep] = False
        slots = torch.nonzero(ok).view(-1)
        if len(slots) > need:
            slots = slots[torch.topk(self.last_use[slots], need, largest=False).indices]
        return slots

    def _unmap(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Evict `slots`; returns (their pages, which were dirty: to write back)."""
        pages, dirty = self.page_of[slots], self.dirty[slots]
        self.slot_of[pages] = -1
        self.page_of[slots] = -1
        self.dirty[slots] = False
        return pages, dirty

    def _map(self, pages: torch.Tensor, slots: torch.Tensor) -> None:
        self.slot_of[pages] = slots.to(torch.int32)
        self.page_of[slots] = pages
        self.last_use[slots] = self._clock

    # -- page-in ahead ----------------------------------------------------------------------
    def page_in(self, pages: torch.Tensor) -> None:
        """Start reading the uncached `pages` on the I/O pool and return (see the module
        docstring, "Page-in ahead"); on the host worker, in program order."""
        self._ahead = pages
        self._page_in(pages)

    def _page_in(self, pages: torch.Tensor) -> None:
        """page_in's pages; what does not fit now (the step before still pins its pages) is
        paged in at the next `release_all` (the end of that step's update)."""
        self._clock += 1
        self._wait_for(pages)  # a page written back is read after its write-back
        missing = pages[self.slot_of[pages] < 0]
        free = self._free()
        keep = self.slot_of[self._ahead]
        victims = self._victims(len(missing) - len(free), keep[keep >= 0])
        fits = len(free) + len(victims)
        missing, self._ahead_rest = missing[:fits], missing[fits:]
        if not len(missing):
            return
        # Reads go to free slots first, then to the victims' slots; a task reads into its own
        # victims' slots after writing those victims back: a slot is reused only after its write.
        bounds = [0, len(missing)]
        if self.io.parallel > 1:  # a task per share of whole runs of adjacent pages
            share = self.io.shares(missing)
            missing = missing[torch.argsort(share, stable=True)]
            edges = torch.arange(self.io.parallel + 1)
            bounds = torch.searchsorted(share.sort(stable=True).values, edges).tolist()
        used = min(len(free), len(missing))
        victim_pages, victim_dirty = self._unmap(victims)
        slots = torch.cat([free[:used], victims])
        self._map(missing, slots)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if a == b:
                continue
            v = slice(max(a, used) - used, max(b, used) - used)  # victims whose slots it reuses
            write = victim_dirty[v]
            self._task_ids += 1
            future = self.io.start(victim_pages[v][write], victims[v][write], missing[a:b],
                                   slots[a:b])  # fmt: skip
            self.loading[slots[a:b]] = self._task_ids
            self.writing[victim_pages[v][write]] = True
            self.tasks[self._task_ids] = _Task(future, slots[a:b], victim_pages[v][write])
        self.paged_in += len(missing)

    # -- demand loads, pins, dirty ----------------------------------------------------------
    def load(
        self, pages: torch.Tensor, overwrite: torch.Tensor | None = None, lookup: bool = False
    ) -> None:
        """Bring `pages` into the cache (LRU unpinned pages out, dirty ones written back).
        `overwrite`: a mask of `pages` the caller overwrites whole: not read, zero-filled.
        `lookup`: a step's lookup pins them (counted: lookup_pages, lookup_hits)."""
        self._clock += 1
        self._wait_for(pages)  # being read ahead or written back: wait for it
        slots = self.slot_of[pages]
        hit = slots >= 0
        if lookup:
            self.lookup_pages += len(pages)
            self.lookup_hits += int(hit.sum())
        self.last_use[slots[hit]] = self._clock
        missing = pages[~hit]
        if not len(missing):
            return
        free = self._free()
        need = len(missing) - len(free)
        victims = self._victims(need, slots[hit])
        if len(victims) < need and self.tasks:  # page-ins hold slots: finish them first
            self.settle()
            victims = self._victims(need, slots[hit])
        if len(victims) < need:
            raise RuntimeError(
                f"NVMe Engram table: {len(pages)} pages needed at once and "
                f"{int((self.pins > 0).sum())} pinned but the host cache holds "
                f"{self.cache_pages} ({self.io.page_bytes} B each): raise "
                "engram.nvme_host_cache_gib (a step's rows must fit)"
            )
        evicted, dirty = self._unmap(victims)
        self.io.write_now(evicted[dirty], victims[dirty])
        use = torch.cat([free, victims])[: len(missing)]
        read = torch.ones(len(missing), dtype=torch.bool)
        if overwrite is not None:
            read = ~overwrite[~hit]
            self.io.slots[use[~read]] = 0.0
        self.io.read_now(missing[read], use[read])
        self._map(missing, use)

    def hold(self, pages: torch.Tensor) -> None:
        """Pin cached `pages` (loaded by `load`) until `release`."""
        slots = self.slot_of[pages]
        if bool((slots < 0).any()):
            raise RuntimeError("NVMe Engram table: a pin of a page not in the cache")
        self.pins[slots] += 1

    def release(self, pages: torch.Tensor) -> None:
        slots = self.slot_of[pages]
        if bool((slots < 0).any()) or bool((self.pins[slots] <= 0).any()):
            raise RuntimeError("NVMe Engram table: a release without its pin")
        self.pins[slots] -= 1

    def release_all(self) -> None:
        self.pins.zero_()
        if len(self._ahead_rest):  # the pages a page-in had no room for while they were pinned
            self._page_in(self._ahead_rest)

    def mark_dirty(self, pages: torch.Tensor) -> None:
        """Cached `pages` were written: they go back to the files when evicted."""
        self.dirty[self.slot_of[pages]] = True

    def flush(self) -> None:
        """Write every dirty cached page back (they stay cached)."""
        slots = torch.nonzero(self.dirty).view(-1)
        self.io.write_now(self.page_of[slots], slots)
        self.dirty[slots] = False
