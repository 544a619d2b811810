"""The planner's markdown: one config's per-rank table (estimate) and the layouts side by side
(--compare). --json prints MemoryEstimate.to_dict() instead."""

from __future__ import annotations

import itertools

from engram.config import JobConfig
from planner.compare import Row, pick
from planner.nvme import nvme_markdown
from planner.results import GIB, MemoryEstimate
from planner.step_model import Machine
from planner.table_checkpoint import table_checkpoint_markdown
from planner.tables import table_memory_markdown


def _gib(n: int) -> str:
    return f"{n / GIB:.3f}"


def _count(n: int) -> str:
    return f"{n:,}"


def _runs(values: list[int]) -> str:
    """'161,628 rows on ranks 0-62, 161,600 on rank 63' (consecutive equal values grouped)."""
    parts = []
    for value, group in itertools.groupby(enumerate(values), key=lambda kv: kv[1]):
        ks = [k for k, _ in group]
        where = f"rank {ks[0]}" if len(ks) == 1 else f"ranks {ks[0]}-{ks[-1]}"
        parts.append(f"{_count(value)} on {where}")
    return ", ".join(parts)


COMM_ROWS = (
    ("FSDP all-gather", "fsdp_all_gather"),
    ("FSDP reduce-scatter", "fsdp_reduce_scatter"),
    ("DP all-reduce (HSDP / DDP replicas)", "dp_all_reduce"),
    ("TP collectives", "tp"),
    ("PP send / recv", "pp_send_recv"),
    ("Engram table all-to-all (no dedup)", "table_all_to_all"),
    ("CP attention exchange + Engram halo", "cp"),
)


FSDP_ROWS = (
    ("all-gather root unit(s), GiB", "root_gather_bytes"),
    ("layer grads + 2 reduce-scatter inputs, GiB", "layer_reduce_bytes"),
    ("root grads (held to end of backward), GiB", "root_grad_bytes"),
    ("root reduce-scatter input, GiB", "root_reduce_bytes"),
)


def _span(layers: list[int]) -> str:
    return f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"


class _RankTable:
    """The per-rank markdown table: one column per reported rank and a 'kind' column."""

    def __init__(self, est: MemoryEstimate) -> None:
        self.est = est
        self.lines: list[str] = []

    def row(self, label: str, values: list[str], kind: str) -> None:
        self.lines.append(f"| {label} | " + " | ".join(values) + f" | {kind} |")

    def each(self, fn) -> list[str]:
        return [fn(m) for m in self.est.ranks]


def _header(est: MemoryEstimate) -> list[str]:
    """Title, the layout and training settings, and the rank table's header."""
    rs = est.ranks
    f0 = rs[0].fsdp
    cols = " | ".join(f"rank {m.rank}" for m in rs)
    return [
        f"## {est.model} at world {est.world_size} ({est.config_file or 'defaults'})",
        "",
        f"{est.parallel_dims}; seq_len {est.seq_len}, local batch {est.local_batch_size}, "
        f"grad accum {est.grad_accum_steps}, activation checkpointing {est.activation_checkpoint}, "
        f"training mode {est.training_mode}; compute {f0.compute_dtype}, reduce "
        f"{f0.reduce_dtype}; float8 {est.float8}"
        + (f"; tp {est.tp}, sequence parallel {est.sequence_parallel}" if est.tp > 1 else "")
        + (f"; pipeline {est.pipeline}" if est.pp > 1 else "")
        + (f"; context parallel cp {est.cp} ({est.cp_method})" if est.cp > 1 else "")
        + ". GiB = 2^30 bytes.",
        "",
        f"| per rank | {cols} | kind |",
        "| --- | " + " | ".join("---:" for _ in rs) + " | --- |",
    ]


def _persistent_rows(t: _RankTable) -> None:
    """Exact bytes held for the whole run: parameters, tables, gradients, optimizer state."""
    est, rs, row, each = t.est, t.est.ranks, t.row, t.each
    if est.pp > 1:
        row(
            "pipeline stages (decoder layers)",
            each(lambda m: ", ".join(f"{s} ({_span(m.stage_layers[s])})" for s in m.stages)),
            "exact",
        )
    row("dense parameters (FSDP shard), count", [_count(m.dense_params) for m in rs], "exact")
    row(
        "dense parameters fp32 = master weights, GiB"
        if est.training_mode != "lora"  # lora.frozen_dtype: the frozen backbone in compute dtype
        else "dense parameters (frozen backbone as held, adapters fp32), GiB",
        [_gib(m.dense_param_bytes) for m in rs],
        "exact",
    )
    for layer, total in est.table_rows_global.items():
        row(
            f"Engram table rows, layer {layer} (of {_count(total)})",
            [_count(m.table_rows.get(layer, 0)) for m in rs],
            "exact",
        )
    row("Engram table parameters fp32, GiB", [_gib(m.table_param_bytes) for m in rs], "exact")
    row("gradients (sharded, fp32), GiB", [_gib(m.grad_bytes) for m in rs], "exact")
    row("optimizer state (2 x fp32 moments), GiB", [_gib(m.optimizer_bytes) for m in rs], "exact")
    row("buffers (RoPE cache), GiB", [_gib(m.buffer_bytes) for m in rs], "exact")
    if any(m.cp_mask_bytes for m in rs):
        row(
            "all-gather K/V attention masks (bool [T/cp, T] per layer, cached), GiB",
            [_gib(m.cp_mask_bytes) for m in rs],
            "formula",
        )
    if any(m.host_bytes for m in rs):
        row("- of which on the host (cpu_offload), GiB", [_gib(m.host_bytes) for m in rs], "exact")
    if est.table_location == "host":
        row(
            "- of which host tables: rows of one micro-batch on device, GiB",
            [_gib(m.host_table_device_bytes) for m in rs],
            "estimate",
        )
    row("**persistent on device**, GiB", [f"**{_gib(m.persistent_bytes)}**" for m in rs], "exact")


def _host_rows(t: _RankTable) -> None:
    """Host-side memory and traffic: host tables, the async checkpoint's staging copy."""
    est, rs, row, each = t.est, t.est.ranks, t.row, t.each
    if est.table_location == "host":
        row(
            "host tables: shard + optimizer state + staging (host memory), GiB",
            [_gib(m.host_table_bytes) for m in rs],
            "exact",
        )
        row(
            f"host <-> device bytes per step (s at {est.host_link_gbs:g} GB/s), GiB",
            each(
                lambda m: (
                    f"{_gib(m.host_link_bytes)} "
                    f"({m.host_link_bytes / (est.host_link_gbs * 1e9):.2f} s)"
                )
            ),
            "estimate",
        )
    if any(m.async_staging_bytes for m in rs):
        row(
            "async checkpoint staging copy (host memory, not device), GiB",
            [_gib(m.async_staging_bytes) for m in rs],
            "exact",
        )


def _transient_rows(t: _RankTable) -> None:
    """What comes and goes within a step: FSDP buffers, activations, casts, optimizer
    temporaries, and the phase that sets the transient peak."""
    est, rs, row, each = t.est, t.est.ranks, t.row, t.each
    f0 = rs[0].fsdp
    gathered = "x2" if f0.layers_reshard_after_forward else "all layers held (no reshard)"
    row(
        f"all-gather largest layer {gathered}, GiB",
        each(lambda m: f"{_gib(m.fsdp.layer_gather_bytes)} ({m.fsdp.largest_layer})"),
        "exact shapes",
    )
    for label, attr in FSDP_ROWS:
        row(label, each(lambda m, a=attr: _gib(getattr(m.fsdp, a))), "exact shapes")
    row(
        "unsharded grads kept across micro-batches (no-sync), GiB",
        each(lambda m: _gib(m.fsdp.no_sync_accum_bytes)),
        "exact shapes" if est.no_sync_accumulation else "not modelled: no no-sync accumulation",
    )
    if est.pp > 1:
        row(
            "micro-batches in flight at the peak, per stage",
            each(lambda m: ", ".join(f"{s}: {n}" for s, n in m.activations.in_flight.items())),
            "schedule order",
        )
    row(
        "activations saved to backward, GiB",
        each(lambda m: _gib(m.activations.saved_bytes)),
        "estimate",
    )
    row(
        "one layer's recompute + backward temporaries, GiB",
        each(lambda m: _gib(m.activations.recompute_bytes)),
        "estimate",
    )
    row(
        "loss head (logits, fp32 cross-entropy), GiB",
        each(lambda m: _gib(m.activations.loss_bytes)),
        "estimate",
    )
    row(
        "model output held through backward (both backward phases), GiB",
        each(lambda m: _gib(m.activations.held_output_bytes)),
        "estimate",
    )
    row(
        "gradients not there yet at the loss (one micro-batch per step), GiB",
        each(lambda m: _gib(-m.grad_bytes if m.grads_freed_at_loss else 0)),
        "exact",
    )
    row("BLAS / operator workspaces, GiB", each(lambda m: _gib(m.workspace_bytes)), "allowance")
    if est.float8 != "off":
        row(
            "float8 casts of one linear, GiB",
            each(lambda m: f"{_gib(m.float8_cast_bytes)} ({m.float8_largest_linear})"),
            "estimate",
        )
    row(
        "optimizer step temporaries (foreach), GiB",
        [_gib(m.optimizer_step_temp_bytes) for m in rs],
        "estimate",
    )
    row(
        "**transient peak**, GiB",
        [f"**{_gib(m.transient_bytes)}** ({m.peak_phase})" for m in rs],
        "sum of the above at that phase",
    )


def _peak_rows(t: _RankTable) -> None:
    """The assumptions on top of the transient peak, the estimated peak and the headroom."""
    est, rs, row, each = t.est, t.est.ranks, t.row, t.each
    row(
        f"allocator fragmentation ({est.fragmentation:.0%}), GiB",
        [_gib(m.fragmentation_bytes) for m in rs],
        "assumption",
    )
    row(
        "runtime context + collective buffers, GiB",
        each(lambda m: _gib(est.reserve_bytes)),
        "assumption",
    )
    row("**estimated peak**, GiB", [f"**{_gib(m.peak_bytes)}**" for m in rs], "estimate")
    row("device memory, GiB", each(lambda m: _gib(est.device_memory_bytes)), "--device_memory_gib")
    row("headroom, GiB", [_gib(m.headroom_bytes) for m in rs], "estimate")


def _comm_rows(t: _RankTable) -> None:
    for label, key in COMM_ROWS:
        t.row(
            f"{label}, GiB received per step",
            t.each(lambda m, k=key: _gib(getattr(m.comm, k))),
            "formula",
        )


def _verdict(est: MemoryEstimate) -> list[str]:
    """Whether host tables and the rank fit, and how gradient accumulation was modelled."""
    f0 = est.ranks[0].fsdp
    lines = []
    if est.table_location == "host":
        have = (
            f"{_gib(est.host_memory_bytes)} GiB available per node"
            if est.host_memory_bytes
            else "host memory not stated (engram.host_memory_gib / --host_memory_gib)"
        )
        lines += [
            "",
            f"Host tables per node ({est.ranks_per_node} ranks x the largest reported rank): "
            f"{_gib(est.host_table_bytes_per_node)} GiB of {have}: "
            f"**{'fits' if est.host_fits else 'does NOT fit'}**.",
        ]
    lines += nvme_markdown(est.nvme)
    lines += table_checkpoint_markdown(est.table_checkpoint, est.table_location)
    lines += ["", f"Fits: **{'yes' if est.fits else 'NO'}**."]
    if est.recipe_defers_grad_sync and not est.no_sync_accumulation:
        lines += [
            "",
            "Modelled with --sync_every_micro_batch: gradients reduce-scattered after every "
            "micro-batch, NOT what recipes/train.py does today (it skips the sync on non-last "
            "micro-batches).",
        ]
    if est.no_sync_accumulation:
        why = (
            "under PP, torch's pipeline stage turns gradient sync off for all but the last of "
            "a step's micro-batches"
            if est.pp > 1
            else f"with grad_accum_steps = {est.grad_accum_steps}, recipes/train.py turns "
            "gradient sync off on non-last micro-batches"
        )
        lines += [
            "",
            f"Note: {why}; FSDP2 then keeps every unit's unsharded gradient in "
            f"{f0.reduce_dtype} until the last micro-batch "
            f"({_gib(f0.no_sync_accum_bytes)} GiB on rank {est.ranks[0].rank}).",
        ]
    return lines


def _all_ranks_section(est: MemoryEstimate) -> list[str]:
    a = est.all_ranks
    rows_summary = "; ".join(f"layer {layer}: {_runs(r)}" for layer, r in a.table_rows.items())
    return [
        "",
        "### All ranks (DTensor placement math from one built rank per pipeline stage)",
        "",
        f"- dense parameters summed over {a.world_size} ranks: {_count(a.dense_params_sum)} "
        f"(global {_count(est.global_dense_params)} x {a.replicas} replica(s)); per rank min "
        f"{_count(a.dense_params_min)}, "
        f"max {_count(a.dense_params_max)}",
        f"- Engram table rows: {rows_summary or 'no Engram tables'}",
    ]


def _replicated_tables_section(est: MemoryEstimate) -> list[str]:
    """What the tables would cost replicated (DDP, ZeRO-1/2) beside this repo's row sharding."""
    b = est.replicated_tables
    lines = [
        "",
        "### Replicated-table baselines (formula, fp32 tables, Adam)",
        "",
        "| Engram table state per rank | GiB |",
        "| --- | ---: |",
        f"| DDP: full table + full grad + Adam (16 B/param x {_count(b.table_params_total)}) | {_gib(b.ddp_bytes)} |",
        f"| ZeRO-1: full table + full grad, Adam / {est.world_size} | {_gib(b.zero1_bytes)} |",
        f"| ZeRO-2: full table + full dense grad in backward, grad shard and Adam / {est.world_size} | {_gib(b.zero2_bytes)} |",
        f"| row-sharded (this repo, measured, worst reported rank) | {_gib(b.row_sharded_bytes_max)} |",
        f"| estimated peak of the worst rank with DDP-replicated tables | {_gib(b.peak_with_ddp_tables_max)} |",
    ]
    n_rows = sum(est.table_rows_global.values())
    dim = est.global_table_params // n_rows if n_rows else 0
    return lines + table_memory_markdown(est.table_rows_global, dim, est.world_size // est.pp)


def to_markdown(est: MemoryEstimate) -> str:
    """One config's estimate: the per-rank table, the verdict and the all-ranks and
    replicated-table sections."""
    table = _RankTable(est)
    for section in (_persistent_rows, _host_rows, _transient_rows, _peak_rows, _comm_rows):
        section(table)
    lines = (
        _header(est)
        + table.lines
        + _verdict(est)
        + _all_ranks_section(est)
        + _replicated_tables_section(est)
    )
    return "\n".join(lines) + "\n"


def _g(n: int) -> str:
    return f"{n / GIB:.1f}"


def compare_markdown(
    cfg: JobConfig, world: int, rows: list[Row], node: int, machine: Machine, margin: float
) -> str:
    device = cfg.job.device
    out = [
        f"## Layouts for {cfg.model.name}/{cfg.model.flavor} at world {world} "
        f"({cfg.job.config_file or 'defaults'}), seq_len {cfg.training.seq_len}, device {device}",
        "",
        "Peak: the worst pipeline stage's estimated peak per rank (GiB). Communication: GiB one "
        "rank receives per optimizer step (FSDP all-gather + reduce-scatter, HSDP / DDP "
        "all-reduce, TP, PP send / recv, Engram table all-to-all without dedup, CP attention "
        "exchange + Engram halo) on that rank; "
        f"inter-node: the part whose groups span nodes of {node} devices. Bubble: idle "
        "fraction of the ideal schedule (scripts/pipeline_memory.py). Step: a rough model, "
        "max(compute, FSDP / DP communication) + TP, PP, table and CP communication (on the "
        f"critical path), with {machine.peak_tflops:g} TFLOPS x MFU "
        f"{machine.mfu:g} per device, {machine.inter_node_gbs:g} GB/s between nodes and "
        f"{machine.intra_node_gbs:g} GB/s inside a node per device (assumptions: "
        "--peak_tflops, --mfu, --inter_node_gbs, --intra_node_gbs).",
        "",
        "| layout | micro-batches per step | bubble | peak GiB | headroom GiB | fits | "
        "FSDP AG + RS | DP AR | TP | PP | tables a2a | CP | total comm | inter-node comm | "
        "compute s | overlapped comm s | exposed comm s | step s | note |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if r.estimate is None:
            out.append(f"| {r.layout} | | | | | invalid | | | | | | | | | | | | | {r.error} |")
            continue
        worst = max(r.estimate.ranks, key=lambda m: m.peak_bytes)
        c = worst.comm
        note = []
        if r.estimate.tp > 1 and device == "npu":
            note.append("TP: parallelize_module unvalidated on torch_npu A2/A3")
        if r.estimate.pp > 1:
            note.append(f"worst stage {worst.stages}")
        if not r.estimate.host_fits:
            note.append(
                f"host tables {_g(r.estimate.host_table_bytes_per_node)} GiB per node > "
                f"{_g(r.estimate.host_memory_bytes)}"
            )
        if r.estimate.nvme and r.estimate.nvme.problems:
            note += [p.split(":")[0] for p in r.estimate.nvme.problems]
        out.append(
            f"| {r.layout} | {r.micro} | {r.bubble:.0%} | {_g(worst.peak_bytes)} | "
            f"{_g(worst.headroom_bytes)} | {'yes' if r.estimate.fits else 'NO'} | "
            f"{_g(c.fsdp_all_gather + c.fsdp_reduce_scatter)} | {_g(c.dp_all_reduce)} | "
            f"{_g(c.tp)} | {_g(c.pp_send_recv)} | {_g(c.table_all_to_all)} | {_g(c.cp)} | "
            f"{_g(c.total)} | "
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
