"""Candidate parallel layouts: names (FSDP64, HSDP8x8, PP2xTP4xFSDP8, CP8xFSDP8), the config of
a layout at the same global batch, and which of its collectives span nodes."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from engram.config import ConfigError, JobConfig
from planner.results import CommPerStep


@dataclass
class Layout:
    name: str
    pp: int = 1
    tp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    cp_method: str = ""
    """parallelism.cp_method for cp > 1; "" keeps the config's."""

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp_replicate * self.dp_shard * self.cp


_PART = re.compile(r"(PP|TP|CP|FSDP|DDP|HSDP)(\d+)(?:x(\d+))?$")


def parse_layout(name: str) -> Layout:
    """'PP2xTP4xFSDP8' -> Layout(pp=2, tp=4, dp_shard=8); 'CP8xFSDP8' -> Layout(cp=8,
    dp_shard=8) (FSDP then shards over dp_shard x cp = 64); HSDP<r>x<s> is one term."""
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
                "DDP<n>, TP<t>, CP<c>, PP<p> joined by 'x', e.g. PP2xTP4xFSDP8 or CP8xFSDP8"
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
        elif kind == "CP":
            out.cp = n
        else:
            out.pp = n
    return out


def cp_layouts(world: int, node: int, cps: list[int]) -> list[str]:
    """Context-parallel candidates for each degree in `cps`: CP<c> x FSDP (the cp group inside
    a node when c <= node) and CP<c> x TP<t> x FSDP with c x t <= node."""
    names = []
    for c in cps:
        if c > 1 and world % c == 0 and world > c:
            names.append(f"CP{c}xFSDP{world // c}")
        for tp in (2, 4):
            if c > 1 and c * tp <= node and world % (c * tp) == 0 and world > c * tp:
                names.append(f"CP{c}xTP{tp}xFSDP{world // (c * tp)}")
    return names


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
    old_dp = world // (cfg.parallelism.pp * cfg.parallelism.tp * cfg.parallelism.cp)
    global_seqs = t.global_batch_size or t.local_batch_size * t.grad_accum_steps * old_dp
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
        cp=layout.cp,
        cp_method=layout.cp_method or cfg.parallelism.cp_method,
    )
    return dataclasses.replace(cfg, training=training, parallelism=parallelism, pipeline=pipeline)


def spans_nodes(layout: Layout, node: int) -> dict[str, bool]:
    """Which collectives' process groups span nodes. Ranks are laid out pp, dp_replicate,
    dp_shard, cp, tp (tp innermost, consecutive ranks share a node): a group stays inside a node
    when its span (stride x size) is at most `node`."""
    tp, cp, s, r = layout.tp, layout.cp, layout.dp_shard, layout.dp_replicate
    return {
        "tp": tp > node,
        "cp": cp * tp > node,  # the cp group; its halo spans cp x tp, the same ranks' span
        "fsdp_all_gather": tp * cp * s > node,  # FSDP shards over dp_shard x cp
        "fsdp_reduce_scatter": tp * cp * s > node,
        "dp_all_reduce": tp * cp * s * r > node,
        "table_all_to_all": tp * cp * s * r > node,  # the tables span a stage's dp x cp x tp
        "pp_send_recv": layout.pp > 1 and tp * cp * s * r >= node,
    }


def inter_node_bytes(layout: Layout, comm: CommPerStep, node: int) -> int:
    """The part of `comm` whose process groups span nodes."""
    return sum(getattr(comm, k) for k, inter in spans_nodes(layout, node).items() if inter)
