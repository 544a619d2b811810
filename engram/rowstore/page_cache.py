"""The NVMe row store's page cache: which page is in which slot of the host cache, least
recently used first out, dirty pages written back when evicted, pins, and pages read ahead of
their step.

Cache. `cache_bytes` of page slots (page_io.py owns them), least recently used first out; a
dirty page is written back when it is evicted (and by `flush`). `pin(pages)` loads pages and
holds them until `release(pages)`: a step's rows stay in host memory from prefetch to their last
use, so reads and updates never wait on the disk mid-step. A pin that cannot fit the cache is
refused, naming the setting to raise. The cache is not thread-safe: the tables use it from the
one FIFO host worker (engram/rowstore/host_worker.py).

Page-in ahead. `page_in(pages)` (queued on the worker while step N computes, with step N+1's
pages) starts reading the uncached pages into free or evicted slots on the I/O pool and returns
at once; the reads (and the write-backs of the dirty pages they evict) overlap the step. Why the
rows a step sees stay exactly those of the device tier:

- Every cache-state mutation (which page is in which slot, dirty, pinned, loading, being
  written back) happens on the one FIFO worker, in program order with every read and update;
  the I/O threads only move bytes between a slot they were given and the file.
- A page missing from the cache has its latest value on disk, or on its way there: an evicted
  dirty page is in `writing` until its write-back completes, and anything that needs it again
  (a load, a page-in, a read-out) waits for that write first, so it never reads stale bytes.
- A page being read (`loading`) is in neither the cache map nor the free list: nothing evicts
  it, writes it or reads its slot; the first load, pin, read or write of it waits for its read
  and only then maps it. Its disk value is final: it was not cached, so no update could change
  it, and no update can run on it before its read completes.
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
from collections import OrderedDict
from concurrent.futures import Future

import torch

from engram.rowstore.page_io import PageIO

__all__ = ["PageCache"]


class PageCache:
    """`io.slots` as a cache of the store's pages (see the module docstring)."""

    def __init__(self, io: PageIO, pages: int, cache_pages: int) -> None:
        self.io, self.cache_pages = io, cache_pages
        self.free = list(range(cache_pages - 1, -1, -1))
        self.where: OrderedDict[int, int] = OrderedDict()  # page -> slot, LRU first
        self.slot_of = torch.full((pages,), -1, dtype=torch.long)  # the same, as a tensor
        self.dirty: set[int] = set()
        self.pins: dict[int, int] = {}  # page -> pin count
        self.loading: dict[int, tuple[int, Future]] = {}  # page -> (slot, its read): page_in
        self.writing: dict[int, Future] = {}  # evicted page -> its write-back (page_in)
        self._ahead: list[int] = []  # the pages of the last page_in (kept by its evictions)
        self._ahead_rest: list[int] = []  # those it had no room for yet
        self.paged_in = 0  # pages read ahead by page_in
        self.page_in_waits = 0  # page-ins still in flight when a load needed the page
        self.page_in_wait_s = 0.0  # seconds loads waited for those
        self.lookup_pages = self.lookup_hits = 0  # pages lookups pinned; of them, resident

    def settle(self, pages) -> None:
        """Wait for the page-in reads and write-backs of `pages` (their errors raise here); the
        pages read become cached (most recently used)."""
        mapped, slots, done = [], [], set()  # a task moves many pages: check it once
        for p in pages:
            if p in self.writing:
                write = self.writing.pop(p)
                if write not in done:
                    write.result()
                    done.add(write)
            if p in self.loading:
                slot, read = self.loading.pop(p)
                if read not in done:
                    waited, t0 = not read.done(), time.perf_counter()
                    read.result()
                    if waited:
                        self.page_in_waits += 1
                        self.page_in_wait_s += time.perf_counter() - t0
                    done.add(read)
                self.where[p] = slot
                mapped.append(p)
                slots.append(slot)
        self._map(mapped, slots)

    def _map(self, pages: list[int], slots: list[int] | int) -> None:
        """The slot-of-page tensor for `pages` (one index op: per-page tensor writes cost us)."""
        if pages:
            self.slot_of[torch.tensor(pages)] = torch.tensor(slots)

    def _reap(self) -> None:
        """Settle the page-in reads and write-backs that have finished."""
        self.settle([p for p, f in self.writing.items() if f.done()])
        self.settle([p for p, (_, f) in self.loading.items() if f.done()])

    def _victims(self, need: int, keep: set[int]) -> list[int]:
        """Up to `need` cached pages to evict, least recently used first: never a pinned page
        nor one of `keep`."""
        victims = []
        for p in self.where if need > 0 else ():
            if p not in self.pins and p not in keep:
                victims.append(p)
                if len(victims) == need:
                    break
        return victims

    def page_in(self, pages: list[int]) -> None:
        """Start reading the uncached `pages` on the I/O pool and return (see the module
        docstring, "Page-in ahead"); on the host worker, in program order."""
        self._ahead = pages
        self._page_in(self._ahead)

    def _page_in(self, pages: list[int]) -> None:
        """page_in's pages; what does not fit now (the step before still pins its pages) is
        paged in at the next `release_all` (the end of that step's update)."""
        self._reap()
        self.settle([p for p in pages if p in self.writing])  # read it after its write-back
        missing = [p for p in pages if p not in self.where and p not in self.loading]
        victims = self._victims(len(missing) - len(self.free), set(self._ahead))
        fits = len(self.free) + len(victims)
        missing, self._ahead_rest = missing[:fits], missing[fits:]
        if not missing:
            return
        cut = len(self.free) - min(len(missing), len(self.free))
        free, taken = self.free[cut:], []
        del self.free[cut:]
        for victim in victims:
            taken.append((victim, self.where.pop(victim), victim in self.dirty))
            self.dirty.discard(victim)
        self._map(victims, -1)
        # A share (one task) reads its runs into free slots first, then into its own victims'
        # slots, after writing those victims back: a slot is reused only after its write.
        for share in self.io.shares(self.io.runs([(p, -1) for p in missing])):
            reads, writes = [], []
            for run in share:
                placed = []
                for page, _ in run:
                    if free:
                        slot = free.pop()
                    else:
                        victim, slot, dirty = taken.pop()
                        if dirty:
                            writes.append((victim, slot))
                    placed.append((page, slot))
                reads.append(placed)
            task = self.io.start(writes, reads)
            for page, _ in writes:
                self.writing[page] = task
            for run in reads:
                for page, slot in run:
                    self.loading[page] = (slot, task)
        self.paged_in += len(missing)

    def load(self, pages: list[int], lookup: bool = False) -> None:
        """Bring `pages` into the cache (LRU unpinned pages out, dirty ones written back).
        `lookup`: a step's lookup pins them (counted: lookup_pages, lookup_hits)."""
        if self.loading or self.writing:
            self._reap()
            self.settle(pages)  # being read ahead or written back: wait for it
        missing = [p for p in pages if p not in self.where]
        if lookup:
            self.lookup_pages += len(pages)
            self.lookup_hits += len(pages) - len(missing)
        for p in pages:
            if p in self.where:
                self.where.move_to_end(p)
        if not missing:
            return
        need, needed = len(missing) - len(self.free), set(pages)
        victims = self._victims(need, needed)
        if len(victims) < need and self.loading:  # page-ins hold slots: finish them first
            self.settle(list(self.loading))
            victims = self._victims(need, needed)
        if len(victims) < need:
            raise RuntimeError(
                f"NVMe Engram table: {len(missing) + len(self.where)} pages pinned or needed "
                f"at once but the host cache holds {self.cache_pages} ({self.io.page_bytes} B "
                "each): raise engram.nvme_host_cache_gib (a step's rows must fit)"
            )
        evict = []
        self._map(victims, -1)
        for victim in victims:
            slot = self.where.pop(victim)
            if victim in self.dirty:
                evict.append((victim, slot))
                self.dirty.discard(victim)
            self.free.append(slot)
        self.io.move_now(evict, write=True)
        jobs = [(p, self.free.pop()) for p in missing]
        self.io.move_now(jobs, write=False)
        for p, slot in jobs:
            self.where[p] = slot
        self._map(missing, [slot for _, slot in jobs])

    def hold(self, pages: list[int]) -> None:
        """Pin cached `pages` (loaded by `load`) until `release`."""
        for p in pages:
            self.pins[p] = self.pins.get(p, 0) + 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            n = self.pins.get(p, 0) - 1
            if n < 0:
                raise RuntimeError("NVMe Engram table: a release without its pin")
            if n:
                self.pins[p] = n
            else:
                self.pins.pop(p)

    def release_all(self) -> None:
        self.pins.clear()
        if self._ahead_rest:  # the pages a page-in had no room for while they were pinned
            self._page_in(self._ahead_rest)

    def flush(self) -> None:
        """Write every dirty cached page back (they stay cached)."""
        self.io.move_now([(p, self.where[p]) for p in sorted(self.dirty)], write=True)
        self.dirty.clear()
