"""Bytes one rank receives per optimizer step, per kind of collective (formulas).

Each number is what a rank receives over the wire in one optimizer step (a ring collective
sends as much as it receives), from this rank's exact local shapes and the layout:

    FSDP all-gather      dense shard (compute dtype) x (S - 1), per gather of a unit, S =
                         dp_shard x cp (FSDP's shard group).
                         Gathers per step: without PP, each micro-batch gathers in forward and,
                         if the layers reshard after forward, again in backward; under PP a
                         stage stays unsharded across its micro-batches: one gather per
                         schedule step.
    FSDP reduce-scatter  trainable shard (reduce dtype) x (S - 1), per gradient sync:
                         every micro-batch without PP (FSDP), once per schedule step under PP,
                         once per step under DDP's no-sync accumulation.
    DP all-reduce        HSDP / DDP across dp_replicate: 2 (R - 1) / R x the trainable shard.
    TP                   sequence parallel: per decoder layer 2 all-gathers + 2
                         reduce-scatters of the [tokens, dim] stream in forward, the same in
                         backward, again in a checkpointed layer's recompute; each moves
                         (tp - 1) / tp of it. Plus the embedding's reduce-scatter and the
                         head's all-gather (forward and backward). Without sequence parallel
                         the all-reduces move the same bytes.
    PP send / recv       per micro-batch, each local stage sends its output (not the last
                         stage) and its input gradient (not the first): [tokens, dim] in the
                         compute dtype, / tp under sequence parallel. Stages on the same rank
                         (the V placement's turn) send nothing.
    table all-to-all     per Engram layer of this rank's stages and micro-batch, for its
                         tokens / tp (Engram runs sequence-sharded in both TP modes): the ids
                         (int64 per head) out, the rows back (`engram_a2a_dtype`), the row
                         gradients out in backward, (E - 1) / E of them remote with E =
                         dp x tp table shards; again in a checkpointed layer's recompute.
                         Without dedup (an upper bound: repeated n-grams are sent once,
                         benchmarks/bench_table_a2a.py measures the saving).

    CP                   per decoder layer and micro-batch (cp > 1; L = B x T / cp local tokens,
                         heads / tp on each TP rank), forward: Ulysses all-to-alls q, k, v and
                         the output, L x (2 Dq + 2 Dkv) / tp x (cp - 1) / cp; all-gather K/V
                         gathers K and V, L x 2 Dkv / tp x (cp - 1); backward moves the same
                         again (the reverse all-to-alls; the reduce-scatter of the K / V
                         gradients), a checkpointed layer's recompute a third time. Plus, per
                         Engram layer, the ShortConv halo: every rank all-gathers every piece's
                         tail over cp x tp, ((kernel_size - 1) x max_ngram positions x
                         hc_mult x dim), forward, backward (reduce-scatter) and recompute.
                         Compute dtype. cp_layer_bytes states it; benchmarks/bench_cp.py counts
                         the real collectives' bytes against it.

Not counted: Engram's ShortConv halo under TP without CP (k-1 positions per layer), the
all-gather of an
Engram block's output without sequence parallel, the small all-reduces of the loss, grad norm,
the loss divisor over cp and Engram block's dense grads over TP, barriers.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from engram.config import JobConfig
from parallelisms.activation_checkpoint import is_checkpointed
from parallelisms.fsdp import DTYPES, defer_grad_sync, reshard_after_forward
from parallelisms.parallel_dims import ParallelDims
from planner.results import CommPerStep


def _local_numel(p: nn.Parameter) -> int:
    return (p.to_local() if isinstance(p, DTensor) else p).numel()


def cp_layer_bytes(args, engram, dims: ParallelDims, batch: int, seq_len: int, a: int):
    """(attention, halo): bytes one rank receives in ONE forward of one decoder layer under
    context parallelism, for a micro-batch of `batch` sequences of `seq_len` tokens in the
    compute dtype of `a` bytes (`args`: ModelArgs). `halo` is that of a layer with an Engram
    block (`engram`: EngramConfig; None: 0). Backward receives as much again (module
    docstring). (0, 0) at cp = 1."""
    cp, tp = dims.cp, dims.tp
    if cp == 1:
        return 0, 0
    dq, dkv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    local = batch * seq_len // cp
    if dims.cp_method == "ulysses":
        attention = local * (2 * dq + 2 * dkv) // tp * (cp - 1) // cp * a
    else:
        attention = local * 2 * dkv // tp * (cp - 1) * a
    halo = 0
    if engram is not None and engram.enabled:
        pieces_per_rank = dims.cp_chunk_count // cp  # cp_chunks
        reach = (engram.kernel_size - 1) * engram.max_ngram
        halo = pieces_per_rank * batch * reach * engram.hc_mult * args.dim * a * (cp * tp - 1)
    return attention, halo


def _fsdp_and_dp(cfg: JobConfig, dims: ParallelDims, out: CommPerStep, shard, trainable, a, r):
    """FSDP all-gather and reduce-scatter over dp_shard x cp, HSDP / DDP all-reduce over
    dp_replicate, for a dense shard of `shard` and `trainable` elements (`a`, `r`: bytes per
    element in the compute and reduce dtypes)."""
    accum = cfg.training.grad_accum_steps
    s, rep = dims.fsdp_size, dims.dp_replicate  # FSDP shards over dp_shard x cp
    if s > 1:
        layer_reshard, _ = reshard_after_forward(dims, cfg.parallelism)
        gathers = accum if dims.pp_enabled else accum * (2 if layer_reshard else 1)
        out.fsdp_all_gather = gathers * shard * (s - 1) * a
    if dims.pp_enabled or not defer_grad_sync(dims):
        syncs = accum
    else:  # DDP: the recipe reduces once, at the last micro-batch
        syncs = 1
    if s > 1:
        out.fsdp_reduce_scatter = syncs * trainable * (s - 1) * r
    if rep > 1:
        out.dp_all_reduce = syncs * 2 * (rep - 1) * trainable * r // rep


def _tp(dims: ParallelDims, mem, plan, layers, recomputed, passes: int, stream: int) -> int:
    """Sequence-parallel (or all-reduce) bytes of the decoder layers, embedding and head."""
    tp = dims.tp
    ops = sum(8 + (4 if i in recomputed else 0) for i in layers)
    first = 0 in mem.stages
    last = plan is None or plan.num_stages - 1 in mem.stages
    ops += 2 * first + 2 * last
    return passes * ops * stream * (tp - 1) // tp


def _pp_send_recv(dims: ParallelDims, mem, plan, passes: int, stream: int) -> int:
    """Activations to the next stage and input gradients to the previous one, when on another
    rank."""
    sends = 0
    for st in mem.stages:
        if st < plan.num_stages - 1 and plan.ranks[st + 1] != plan.ranks[st]:
            sends += 1  # activation to the next stage
        if st > 0 and plan.ranks[st - 1] != plan.ranks[st]:
            sends += 1  # input gradient to the previous stage
    return passes * sends * stream * dims.cp // dims.divisors.stream_tokens


def _table_all_to_all(
    cfg: JobConfig, dims: ParallelDims, engram_layers, recomputed, tokens: int, passes: int
) -> int:
    """Ids out, rows back and row gradients out per Engram layer, the remote part of them."""
    e, p, shards = cfg.engram, cfg.parallelism, dims.divisors.table_rows
    wire = DTYPES[p.engram_a2a_dtype].itemsize if p.engram_a2a_dtype else 4
    local_tokens = tokens // dims.divisors.engram_tokens
    ids = local_tokens * e.num_heads * 8
    rows = local_tokens * e.num_heads * e.head_dim * wire
    per_layer = [
        (ids + rows) * (2 if i in recomputed else 1) + rows for i in engram_layers
    ]  # forward (+ recompute), row gradients in backward
    return passes * sum(per_layer) * (shards - 1) // shards


def comm_per_step(
    cfg: JobConfig, dims: ParallelDims, parts, table_params, mem, plan
) -> CommPerStep:
    """`mem`: this rank's RankMemory (its stages, FSDP dtypes, micro-batch tokens); `plan`: the
    StagePlan under PP, else None."""
    a = DTYPES[mem.fsdp.compute_dtype].itemsize
    r = DTYPES[mem.fsdp.reduce_dtype].itemsize
    tokens = mem.activations.microbatch_tokens
    passes = cfg.training.grad_accum_steps * (
        cfg.training.local_batch_size * cfg.training.seq_len // tokens
    )
    table_ids = {id(t) for t in table_params}
    dense = [q for part in parts for q in part.parameters() if id(q) not in table_ids]
    shard = sum(_local_numel(q) for q in dense)
    trainable = sum(_local_numel(q) for q in dense if q.requires_grad)
    out = CommPerStep()
    _fsdp_and_dp(cfg, dims, out, shard, trainable, a, r)

    layers = [i for s_ in mem.stages for i in mem.stage_layers[s_]]
    recomputed = {
        i
        for s_ in mem.stages
        for k, i in enumerate(mem.stage_layers[s_])
        if is_checkpointed(cfg.activation_checkpoint, k)
    }
    # One [tokens, dim] tensor of this rank's part of the micro-batch (1 / cp of its sequence).
    stream = tokens // dims.cp * parts[0].args.dim * a
    if dims.tp > 1:
        out.tp = _tp(dims, mem, plan, layers, recomputed, passes, stream)
    if plan is not None:
        out.pp_send_recv = _pp_send_recv(dims, mem, plan, passes, stream)
    e = cfg.engram
    engram_layers = [i for i in layers if e.enabled and i in e.layer_ids]
    if engram_layers and dims.divisors.table_rows > 1:
        out.table_all_to_all = _table_all_to_all(
            cfg, dims, engram_layers, recomputed, tokens, passes
        )
    if dims.cp > 1:
        seqs = tokens // cfg.training.seq_len
        attention, halo = cp_layer_bytes(parts[0].args, e, dims, seqs, cfg.training.seq_len, a)
        out.cp = passes * sum(
            (attention + (halo if i in engram_layers else 0)) * (3 if i in recomputed else 2)
            for i in layers
        )
    return out
