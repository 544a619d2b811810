"""Candidate parallel layouts of one config at one world size, side by side.

    python scripts/estimate_memory.py --job.config_file train_configs/32b_npu.toml \
        --world_size 64 --compare [--layouts FSDP64,PP2xTP4xFSDP8] [--node_size 8]

Each layout runs the full estimator (scripts/estimate_memory.py: exact per-rank parameter,
gradient and optimizer bytes under the fake process group, activations per schedule) on one rank
per pipeline stage, which is where ranks differ; ranks of one stage differ only by a few table
rows. The global batch (sequences per optimizer step) is held fixed at the config's
local_batch_size x grad_accum_steps x dp: without PP a layout keeps the config's micro-batch and
changes grad_accum_steps; with PP one schedule step runs the dp rank's whole share as
micro-batches of one sequence each (pipeline.microbatches = local_batch_size, more micro-batches
= smaller bubble) and grad_accum_steps = 1. The schedule is the config's pipeline.schedule
when it sets pp > 1, else 1F1B.

Layout names: FSDP<n>, HSDP<r>x<s>, DDP<n>, TP<t>x..., PP<p>x... (outermost first), e.g.
PP2xTP4xFSDP8. TP needs parallelize_module / ColwiseParallel / RowwiseParallel, which torch_npu
does not yet list as supported on Atlas A2 / A3: on job.device = "npu" those layouts are marked.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from engram.config import ConfigError, JobConfig
from parallelisms.activation_checkpoint import checkpoint_every
from scripts.comm_estimate import CommPerStep
from scripts.estimate_memory import GIB, MemoryEstimate, estimate
from scripts.pipeline_memory import bubble_fraction


@dataclass
class Layout:
    name: str
    pp: int = 1
    tp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp_replicate * self.dp_shard


_PART = re.compile(r"(PP|TP|FSDP|DDP|HSDP)(\d+)(?:x(\d+))?$")


def parse_layout(name: str) -> Layout:
    """'PP2xTP4xFSDP8' -> Layout(pp=2, tp=4, dp_shard=8); HSDP<r>x<s> is one term."""
    out = Layout(name)
    tokens = name.upper().split("X")
    i = 0
    while i < len(tokens):
        kind = re.match(r"[A-Z]+", tokens[i])
        if kind and kind.group() == "HSDP" and i + 1 < len(tokens):
            term, i = f"{tokens[i]}x{tokens[i + 1]}", i + 2
        else:
            term, i = tokens[i], i + 1
        m = _PART.match(term)
        if not m:
            raise ConfigError(
                f"layout {name!r}: cannot read {term!r}; use terms FSDP<n>, HSDP<r>x<s>, "
                "DDP<n>, TP<t>, PP<p> joined by 'x', e.g. PP2xTP4xFSDP8"
            )
        kind, n, m2 = m.group(1), int(m.group(2)), m.group(3)
        if kind == "HSDP":
            if m2 is None:
                raise ConfigError(f"layout {name!r}: HSDP needs <replicas>x<shards>, e.g. HSDP8x8")
            out.dp_replicate, out.dp_shard = n, int(m2)
        elif kind == "FSDP":
            out.dp_shard = n
        elif kind == "DDP":
            out.dp_replicate = n
        elif kind == "TP":
            out.tp = n
        else:
            out.pp = n
    return out


def default_layouts(world: int, node: int) -> list[str]:
    """The usual candidates for `world` ranks in nodes of `node` devices (TP inside a node)."""
    names = [f"FSDP{world}"]
    if world % node == 0 and world > node:
        names.append(f"HSDP{world // node}x{node}")
    for tp in (node // 2, node):
        if tp > 1 and world % tp == 0 and world > tp:
            names.append(f"TP{tp}xFSDP{world // tp}")
    for pp in (2, 4, 8):
        if world % pp == 0 and world > pp:
            names.append(f"PP{pp}xFSDP{world // pp}")
    for pp, tp in ((2, node // 2), (4, node // 4), (2, node), (4, node // 2)):
        if tp > 1 and world % (pp * tp) == 0 and world > pp * tp:
            names.append(f"PP{pp}xTP{tp}xFSDP{world // (pp * tp)}")
    return list(dict.fromkeys(names))


def layout_config(
    cfg: JobConfig, layout: Layout, world: int, local_batch_size: int = 0
) -> JobConfig:
    """The config for `layout` with the same global batch (sequences per optimizer step);
    `local_batch_size` (without PP): sequences per micro-batch, default the config's."""
    if layout.world != world:
        raise ConfigError(f"{layout.name} has {layout.world} ranks, not --world_size {world}")
    t = cfg.training
    old_dp = world // (cfg.parallelism.pp * cfg.parallelism.tp)
    global_seqs = t.local_batch_size * t.grad_accum_steps * old_dp
    dp = layout.dp_replicate * layout.dp_shard
    if global_seqs % dp:
        raise ConfigError(f"global batch {global_seqs} sequences does not split over dp={dp}")
    share = global_seqs // dp
    pipeline = cfg.pipeline
    if layout.pp > 1:
        training = dataclasses.replace(t, local_batch_size=share, grad_accum_steps=1)
        schedule = pipeline.schedule if cfg.parallelism.pp > 1 else "1F1B"
        pipeline = dataclasses.replace(
            pipeline,
            schedule=schedule,
            microbatches=share,
            virtual_stages=pipeline.virtual_stages if cfg.parallelism.pp > 1 else 1,
        )
    else:
        lbs = local_batch_size or t.local_batch_size
        if share % lbs:
            raise ConfigError(
                f"{share} sequences per dp rank: not a multiple of {lbs} per micro-batch"
            )
        training = dataclasses.replace(t, local_batch_size=lbs, grad_accum_steps=share // lbs)
    parallelism = dataclasses.replace(
        cfg.parallelism,
        pp=layout.pp,
        tp=layout.tp,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
    )
    return dataclasses.replace(cfg, training=training, parallelism=parallelism, pipeline=pipeline)


def spans_nodes(layout: Layout, node: int) -> dict[str, bool]:
    """Which collectives' process groups span nodes. Ranks are laid out pp, dp_replicate,
    dp_shard, tp (tp innermost, consecutive ranks share a node): a group stays inside a node
    when its span (stride x size) is at most `node`."""
    tp, s, r = layout.tp, layout.dp_shard, layout.dp_replicate
    return {
        "tp": tp > node,
        "fsdp_all_gather": tp * s > node,
        "fsdp_reduce_scatter": tp * s > node,
        "dp_all_reduce": tp * s * r > node,
        "table_all_to_all": tp * s * r > node,  # the tables span a stage's dp x tp ranks
        "pp_send_recv": layout.pp > 1 and tp * s * r >= node,
    }


def inter_node_bytes(layout: Layout, comm: CommPerStep, node: int) -> int:
    """The part of `comm` whose process groups span nodes."""
    return sum(getattr(comm, k) for k, inter in spans_nodes(layout, node).items() if inter)


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
    (full activation checkpointing; selective: 1 + 1 / (3 x every))."""
    dim = est.model_dim
    embedding = 0 if est.tied_embeddings else est.vocab_size * dim
    matmul = est.global_dense_params - embedding
    attention = 6 * est.n_layers * dim * cfg.training.seq_len
    every = checkpoint_every(cfg.activation_checkpoint)
    recompute = 1 + 1 / (3 * every) if every else 1.0
    return (6 * matmul + attention) * recompute


# Collectives FSDP issues ahead of use (prefetch) or after (reduce-scatter) overlap compute;
# TP collectives, PP send / recv and the table all-to-all sit on the critical path (the next
# matmul needs their result; async TP is not used).
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
    dp = est.world_size // (est.pp * est.tp)
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
    return compute, overlapped, exposed


@dataclass
class Row:
    layout: str
    micro: str
    estimate: MemoryEstimate | None = None
    error: str = ""
    bubble: float = 0.0
    inter_node: int = 0
    compute_s: float = 0.0
    overlapped_s: float = 0.0
    exposed_s: float = 0.0

    @property
    def comm_s(self) -> float:
        return self.overlapped_s + self.exposed_s

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.overlapped_s) + self.exposed_s


def compare(
    cfg: JobConfig,
    world: int,
    layouts: list[str] | None = None,
    node: int = 8,
    machine: Machine | None = None,
    local_batch_sizes: list[int] | None = None,
    **estimate_kwargs,
) -> list[Row]:
    """One row per layout (and, without PP, per micro-batch size in `local_batch_sizes`)."""
    machine = machine or MACHINES.get(cfg.job.device, MACHINES["cuda"])
    rows = []
    runs = []
    for name in layouts or default_layouts(world, node):
        pipelined = "PP" in name.upper()
        for lbs in [0] if pipelined else local_batch_sizes or [0]:
            runs.append((name, lbs))
    for name, lbs in runs:
        try:
            layout = parse_layout(name)
            lcfg = layout_config(cfg, layout, world, lbs)
            stage_first = [c * (world // layout.pp) for c in range(layout.pp)]
            est = estimate(lcfg, world, ranks=stage_first, **estimate_kwargs)
            t = lcfg.training
            micro = (
                f"{t.local_batch_size} x 1 seq ({lcfg.pipeline.schedule})"
                if layout.pp > 1
                else f"{t.grad_accum_steps} x {t.local_batch_size} seq"
            )
            p = lcfg.pipeline
            bubble = (
                bubble_fraction(p.schedule, layout.pp, p.virtual_stages, p.microbatches)
                if layout.pp > 1
                else 0.0
            )
            worst = max(est.ranks, key=lambda m: m.peak_bytes)
            inter = inter_node_bytes(layout, worst.comm, node)
            compute_s, overlapped_s, exposed_s = step_seconds(
                est, lcfg, layout, worst.comm, bubble, machine, node
            )
            rows.append(
                Row(
                    name,
                    micro,
                    est,
                    bubble=bubble,
                    inter_node=inter,
                    compute_s=compute_s,
                    overlapped_s=overlapped_s,
                    exposed_s=exposed_s,
                )
            )
        except ConfigError as e:
            rows.append(Row(name, "", error=str(e)))
    return rows


def _g(n: int) -> str:
    return f"{n / GIB:.1f}"


def pick(cfg: JobConfig, rows: list[Row], margin: float) -> Row | None:
    """The planner's choice: among layouts that fit with at least `margin` of the device memory
    to spare (and, on npu, do not need tensor parallelism: torch_npu does not list
    parallelize_module / RowwiseParallel as supported on A2 / A3), the fastest modelled step;
    ties go to less communication time (overlap is never perfect), then to fewer parallel
    dimensions."""
    ok = [
        r
        for r in rows
        if r.estimate is not None
        and min(m.headroom_bytes for m in r.estimate.ranks)
        >= margin * r.estimate.device_memory_bytes
        and not (cfg.job.device == "npu" and r.estimate.tp > 1)
    ]
    return min(
        ok,
        key=lambda r: (round(r.step_s, 1), round(r.comm_s, 1), r.layout.count("x")),
        default=None,
    )


def to_markdown(
    cfg: JobConfig, world: int, rows: list[Row], node: int, machine: Machine, margin: float
) -> str:
    device = cfg.job.device
    out = [
        f"## Layouts for {cfg.model.name}/{cfg.model.flavor} at world {world} "
        f"({cfg.job.config_file or 'defaults'}), seq_len {cfg.training.seq_len}, device {device}",
        "",
        "Peak: the worst pipeline stage's estimated peak per rank (GiB). Communication: GiB one "
        "rank receives per optimizer step (FSDP all-gather + reduce-scatter, HSDP / DDP "
        "all-reduce, TP, PP send / recv, Engram table all-to-all without dedup) on that rank; "
        f"inter-node: the part whose groups span nodes of {node} devices. Bubble: idle "
        "fraction of the ideal schedule (scripts/pipeline_memory.py). Step: a rough model, "
        "max(compute, FSDP / DP communication) + TP, PP and table communication (on the "
        f"critical path), with {machine.peak_tflops:g} TFLOPS x MFU "
        f"{machine.mfu:g} per device, {machine.inter_node_gbs:g} GB/s between nodes and "
        f"{machine.intra_node_gbs:g} GB/s inside a node per device (assumptions: "
        "--peak_tflops, --mfu, --inter_node_gbs, --intra_node_gbs).",
        "",
        "| layout | micro-batches per step | bubble | peak GiB | headroom GiB | fits | "
        "FSDP AG + RS | DP AR | TP | PP | tables a2a | total comm | inter-node comm | "
        "compute s | overlapped comm s | exposed comm s | step s | note |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if r.estimate is None:
            out.append(f"| {r.layout} | | | | | invalid | | | | | | | | | | | | {r.error} |")
            continue
        worst = max(r.estimate.ranks, key=lambda m: m.peak_bytes)
        c = worst.comm
        note = []
        if r.estimate.tp > 1 and device == "npu":
            note.append("TP: parallelize_module unvalidated on torch_npu A2/A3")
        if r.estimate.pp > 1:
            note.append(f"worst stage {worst.stages}")
        out.append(
            f"| {r.layout} | {r.micro} | {r.bubble:.0%} | {_g(worst.peak_bytes)} | "
            f"{_g(worst.headroom_bytes)} | {'yes' if r.estimate.fits else 'NO'} | "
            f"{_g(c.fsdp_all_gather + c.fsdp_reduce_scatter)} | {_g(c.dp_all_reduce)} | "
            f"{_g(c.tp)} | {_g(c.pp_send_recv)} | {_g(c.table_all_to_all)} | {_g(c.total)} | "
            f"{_g(r.inter_node)} | {r.compute_s:.1f} | {r.overlapped_s:.1f} | "
            f"{r.exposed_s:.1f} | {r.step_s:.1f} | "
            f"{'; '.join(note)} |"
        )
    best = pick(cfg, rows, margin)
    out += [
        "",
        f"Planner's pick (fits with >= {margin:.0%} of device memory free"
        + (", no TP on npu" if device == "npu" else "")
        + ", fastest modelled step): "
        + (f"**{best.layout}** ({best.micro})" if best else "**none fits**"),
    ]
    return "\n".join(out) + "\n"
