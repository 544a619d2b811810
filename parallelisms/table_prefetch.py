"""Prefetch of a step's host / NVMe Engram table rows (`prefetch_host_tables`): the hash ids
every table lookup of the step will see on this rank, queued in the order the lookups run,
under every layout; and the page-in of the next step's rows of NVMe tables
(`page_in_nvme_tables`), the same lookups a step ahead.

Each host table keeps its own FIFO of prefetched lookups (parallelisms/engram_tables/host.py);
a lookup takes the head and refuses it when its ids differ (never rows of other ids). So what
must hold, per table, is: the ids of its k-th lookup of the step are the k-th queued. What a
lookup sees, by layout:

- data / context parallel: the rank's micro-batch after the context-parallel cut, the slot of
  the table's Engram layer: hash_ids[:, :, slot].
- tensor parallel: the Engram block runs sequence-sharded, so each TP rank looks up only its
  own T / tp positions of those ids (`SequenceShardedEngram.local_ids`), not the ids of the
  other TP ranks. The table's all-to-all runs over the "engram" mesh (dp x cp x tp ranks of a
  pipeline stage), so the TP ranks of a replica route distinct ids in one collective.
- pipeline parallel: a rank holds only its stages' layers, so only their tables. The schedule
  splits each accumulation micro-batch into `pp_microbatches` pieces along dim 0 (torch's
  `split_args_kwargs_into_chunks`, called here the same way) and runs each stage's forwards in
  micro-batch order: GPipe, 1F1B, Interleaved1F1B and LoopedBFS differ in how they interleave
  stages and backwards, never in a stage's forward order (the split-backward schedules are
  refused with row-sparse tables, parallelisms/pipeline.py). A table belongs to one stage, so
  its queue in micro-batch order is the order of its lookups, whatever the interleaving.
  torch's metadata forward (each stage once on micro-batch 0 when a schedule initialises its
  stages) is not one of the step's lookups: parallelisms/pipeline.py runs it off the queues.
- activation checkpointing: a recompute in backward replays the forward's rows (host.py) and
  looks nothing up, so it needs no prefetch.

Every rank of an "engram" group has the same stages (its pp rank's), the same tables and the
same number of micro-batches, so each prefetches the same lookups in the same order: the id
exchange of every prefetch is a collective over that group. A page-in routes the same lookups
in the same order (the route is a collective too) and the next step's prefetch of each table
takes its routes in that order (parallelisms/engram_tables/nvme.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from engram.models.transformer import unwrap_block
from parallelisms.engram_tables.host import HostShardedEngramTable
from parallelisms.engram_tables.nvme import NvmeShardedEngramTable
from parallelisms.tensor_parallel import SequenceShardedEngram

__all__ = ["page_in_nvme_tables", "prefetch_host_tables", "table_lookups"]


def table_lookups(
    model_parts: list[nn.Module],
) -> list[tuple[nn.Module, HostShardedEngramTable, int]]:
    """(Engram block, its host table, its slot in hash_ids) of this rank's model parts, in
    module order (the same on every rank of a pipeline stage)."""
    found = []
    for part in model_parts:
        for layer in part.layers.values():
            block = getattr(unwrap_block(layer), "engram", None)
            table = getattr(block, "table", None)
            if isinstance(table, HostShardedEngramTable):
                slot = part.engram_layer_order.index(unwrap_block(layer).layer_id)
                found.append((block, table, slot))
    return found


def pipeline_pieces(hash_ids: torch.Tensor, pp_microbatches: int) -> list[torch.Tensor]:
    """The schedule's micro-batches of one batch's hash ids (the whole batch without PP)."""
    if pp_microbatches == 1:
        return [hash_ids]
    _, kwargs = split_args_kwargs_into_chunks((), {"hash_ids": hash_ids}, pp_microbatches)
    return [k["hash_ids"] for k in kwargs]


def step_lookups(
    model_parts: list[nn.Module], batches_hash_ids: list[torch.Tensor], pp_microbatches: int
) -> Iterator[tuple[HostShardedEngramTable, torch.Tensor]]:
    """(table, the ids it looks up) for every host / NVMe table lookup of one step on this rank,
    in the order the lookups run (per table; the module docstring says why, by layout)."""
    lookups = table_lookups(model_parts)
    for hash_ids in batches_hash_ids:
        for piece in pipeline_pieces(hash_ids, pp_microbatches):
            for block, table, slot in lookups:
                ids = piece[:, :, slot]
                if isinstance(block, SequenceShardedEngram):
                    ids = block.local_ids(ids)
                yield table, ids


def prefetch_host_tables(
    model_parts: list[nn.Module], batches_hash_ids: list[torch.Tensor], pp_microbatches: int = 1
) -> int:
    """Queue every host / NVMe table lookup of one step (the id exchange now, the gathers on the
    host worker); returns how many were queued. `batches_hash_ids`: the step's accumulation
    micro-batches' hash ids [B, T, L, H] (after the context-parallel cut), in the order they
    run; `pp_microbatches`: the pipeline schedule's micro-batches per batch (1 without PP). Call
    it after the previous step's optimizer step (the gathers queue behind its update)."""
    queued = 0
    for table, ids in step_lookups(model_parts, batches_hash_ids, pp_microbatches):
        table.prefetch(ids)
        queued += 1
    return queued


def page_in_nvme_tables(
    model_parts: list[nn.Module], batches_hash_ids: list[torch.Tensor], pp_microbatches: int = 1
) -> int:
    """Start paging in the rows of every NVMe table lookup of the next step (the id exchange
    now, the page reads on the store's I/O pool); returns how many lookups. Arguments as for
    `prefetch_host_tables`, with the next step's micro-batches; call it after this step's
    prefetch, so the next step's prefetch finds the routes in its own order."""
    paged = 0
    for table, ids in step_lookups(model_parts, batches_hash_ids, pp_microbatches):
        if isinstance(table, NvmeShardedEngramTable):
            table.page_in_ahead(ids)
            paged += 1
    return paged
