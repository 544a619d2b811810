"""The rough step-time model of --compare: compute at an assumed MFU, communication at assumed
bandwidths, FSDP / DP collectives overlapped with compute, the rest on the critical path."""

from __future__ import annotations

from dataclasses import dataclass

from engram.config import JobConfig
from parallelisms.activation_checkpoint import checkpoint_every
from planner.layouts import Layout, spans_nodes
from planner.results import CommPerStep, MemoryEstimate


@dataclass
class Machine:
    """Assumptions of the step-time model (per device); override with the --compare flags."""

    peak_tflops: float
    mfu: float
    inter_node_gbs: float
    intra_node_gbs: float


# Atlas 800T A2 (910B: 313 bf16 TFLOPS, one 200 GbE RoCE port and HCCS per NPU); H100 SXM
# (989 dense bf16 TFLOPS, 400 Gb/s InfiniBand and NVLink 4 per GPU). Sustained bandwidths.
MACHINES = {
    "npu": Machine(313.0, 0.40, 25.0, 150.0),
    "cuda": Machine(989.0, 0.40, 50.0, 450.0),
}


def flops_per_token(est: MemoryEstimate, cfg: JobConfig) -> float:
    """Training FLOPs per token: 6 x dense matmul parameters (the input embedding is a lookup)
    + causal attention 6 x layers x dim x seq, x 4/3 when every layer recomputes its forward
    (full activation checkpointing; selective: 1 + 1 / (3 x every)). All-gather K/V attends
    with an explicit [T / cp, T] mask, so its kernel computes every score, masked or not:
    twice the causal attention FLOPs; so does SDPA with packed documents' mask
    (model.attn_mask_type = block_causal). FlexAttention skips masked blocks: estimated as
    causal (an upper bound: documents shorter than T need less)."""
    dim = est.model_dim
    embedding = 0 if est.tied_embeddings else est.vocab_size * dim
    matmul = est.global_dense_params - embedding
    attention = 6 * est.n_layers * dim * cfg.training.seq_len
    documents = cfg.model.attn_mask_type == "block_causal" and cfg.model.attn_backend == "sdpa"
    if documents or (est.cp > 1 and est.cp_method == "allgather_kv"):
        attention *= 2
    every = checkpoint_every(cfg.activation_checkpoint)
    recompute = 1 + 1 / (3 * every) if every else 1.0
    return (6 * matmul + attention) * recompute


# Collectives FSDP issues ahead of use (prefetch) or after (reduce-scatter) overlap compute;
# TP collectives, PP send / recv, the table all-to-all and CP's attention exchange and halo sit
# on the critical path (the next matmul or the kernel needs their result; async TP is not used).
OVERLAPPED = ("fsdp_all_gather", "fsdp_reduce_scatter", "dp_all_reduce")


def step_seconds(
    est: MemoryEstimate,
    cfg: JobConfig,
    layout: Layout,
    comm: CommPerStep,
    bubble: float,
    m: Machine,
    node: int,
) -> tuple[float, float, float]:
    """(compute, overlapped communication, exposed communication) seconds per optimizer step;
    the step takes about max(compute, overlapped) + exposed."""
    t = cfg.training
    dp = est.world_size // (est.pp * est.tp * est.cp)
    tokens = t.local_batch_size * t.grad_accum_steps * dp * t.seq_len
    compute = flops_per_token(est, cfg) * tokens / (est.world_size * m.peak_tflops * 1e12 * m.mfu)
    compute /= 1 - bubble
    overlapped = exposed = 0.0
    for kind, inter in spans_nodes(layout, node).items():
        seconds = getattr(comm, kind) / ((m.inter_node_gbs if inter else m.intra_node_gbs) * 1e9)
        if kind in OVERLAPPED:
            overlapped += seconds
        else:
            exposed += seconds
    # Host tables: their rows and row gradients cross the host link, prefetched / updated
    # beside compute (parallelisms/engram_tables/host.py): counted as overlapped.
    worst = max((r.host_link_bytes for r in est.ranks), default=0)
    if worst and est.host_link_gbs:
        overlapped += worst / (est.host_link_gbs * 1e9)
    return compute, overlapped, exposed
