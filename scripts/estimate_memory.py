"""Per-rank device memory of a real config at its real world size, without the hardware.

    python scripts/estimate_memory.py --job.config_file train_configs/32b_npu.toml --world_size 64 \
        [--ranks 0,1,32,63 | --ranks all] [--device_memory_gib 64] [--json] [--section.key=value ...]

One process plays each requested rank in turn: torch's fake process group (collectives are no-ops)
at the real world size, the model built on the meta device (nothing is allocated) and wrapped by
recipes/train.py's own `parallelisms.parallelize.parallelize_model` (the one statement of the
order of float8, table sharding, activation checkpointing, compile and FSDP2). Parameter,
gradient and optimizer-state bytes are then EXACT:
they are read from the local shapes of the sharded DTensors. FSDP buffers (all-gather,
reduce-scatter, gradient accumulation) are computed from the exact unit shapes with FSDP2's
padding; activations, allocator fragmentation and runtime/collective buffers are ESTIMATES
(formulas and assumptions stated next to each number; see docs/memory_estimate.md).

Modelled: FSDP2 / HSDP / DDP, activation checkpointing, CPU offload, float8 (torchao keeps the
weights in high precision and casts them per layer: only transient float8 copies are added),
tensor parallelism (parameter bytes from the sharded DTensors; activations divided by tp under
sequence parallel, see activation_estimate), pipeline parallelism (each rank builds its own
stages with parallelisms.pipeline.split_stages, exactly as the recipe; FSDP keeps a stage's
parameters and unsharded gradients across its micro-batches; saved activations are counted
micro-batch by micro-batch along torch's own schedule order, scripts/pipeline_memory.py).
Compile is estimated as eager (inductor usually saves activation memory, never adds much).

`--compare` prints candidate layouts side by side instead (scripts/compare_layouts.py): peak per
rank, communication per step and a fit verdict.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# DTensor's own placement math (what to_local() shapes come from), evaluated at other coordinates.
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

# The script runs from its checkout (python scripts/estimate_memory.py), not an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.config import ConfigError, JobConfig, load_config  # noqa: E402
from engram.data.tokenizer import load_tokenizer  # noqa: E402
from engram.hashing import engram_table_rows  # noqa: E402
from engram.lazy_adam import table_memory_bytes, table_memory_markdown  # noqa: E402
from engram.models.args import ModelArgs  # noqa: E402
from engram.models.builder import build_model, flavor_args  # noqa: E402
from engram.models.transformer import clean_fqn  # noqa: E402
from engram.optim import apply_training_mode  # noqa: E402
from parallelisms.activation_checkpoint import is_checkpointed  # noqa: E402
from parallelisms.float8 import check_float8_device  # noqa: E402
from parallelisms.fsdp import DTYPES, defer_grad_sync, reshard_after_forward  # noqa: E402
from parallelisms.parallel_dims import ParallelDims, parallel_dims_from_config  # noqa: E402
from parallelisms.parallelize import parallelize_model  # noqa: E402
from parallelisms.pipeline import StagePlan, check_schedule, split_stages  # noqa: E402
from scripts.comm_estimate import CommPerStep, comm_per_step  # noqa: E402
from scripts.pipeline_memory import in_flight  # noqa: E402

GIB = 1024**3


def _bytes(dtype_name: str) -> int:
    """Bytes per element of a parallelism.mixed_precision_* dtype (parallelisms/fsdp.py's table)."""
    return DTYPES[dtype_name].itemsize


# exp_avg + exp_avg_sq, fp32, same local shape as the parameter (AdamW and LazyRowAdam alike).
ADAM_STATES = 2
DEVICE_MEMORY_GIB = {"npu": 64.0, "cuda": 80.0}  # Atlas 800T A2 (910B) / A100-H100 80 GB


# --------------------------------------------------------------------------- results


@dataclass
class RankMemory:
    """Exact per-rank numbers (local DTensor shapes) plus this rank's estimated peak."""

    rank: int
    dense_params: int
    """FSDP-managed parameters held by this rank (local shard numel)."""
    dense_param_bytes: int
    """fp32 shard = the master weights (FSDP2 keeps no other persistent copy)."""
    table_rows: dict[int, int]
    """Engram layer id -> rows of its table on this rank."""
    table_params: int
    table_param_bytes: int
    grad_bytes: int
    """Sharded gradients of the trainable parameters (dense + tables), param dtype."""
    optimizer_bytes: int
    """AdamW / LazyRowAdam: exp_avg + exp_avg_sq per trainable parameter, fp32."""
    buffer_bytes: int
    optimizer_step_temp_bytes: int
    """Estimate: foreach AdamW allocates ~one temporary copy of its largest parameter group."""
    host_bytes: int
    """Dense params + grads + optimizer state kept in host memory (parallelism.cpu_offload)."""
    persistent_bytes: int = 0
    phases: dict[str, int] = field(default_factory=dict)
    peak_phase: str = ""
    transient_bytes: int = 0
    fragmentation_bytes: int = 0
    reserve_bytes: int = 0
    peak_bytes: int = 0
    headroom_bytes: int = 0
    async_staging_bytes: int = 0
    """checkpoint.async_mode = "async": DCP async_save stages a host copy of this rank's model and
    optimizer state (host memory, not device); 0 when saves are synchronous."""
    stages: list[int] = field(default_factory=lambda: [0])
    """Pipeline stages this rank runs (stage 0 of 1 without PP)."""
    stage_layers: dict[int, list[int]] = field(default_factory=dict)
    """Stage index -> its decoder layer ids (this rank's stages)."""
    fsdp: FsdpBuffers | None = None
    """FSDP buffers of this rank's stages (exact unit shapes)."""
    activations: RankActivations | None = None
    float8_cast_bytes: int = 0
    float8_largest_linear: str = ""
    comm: CommPerStep | None = None


@dataclass
class ActivationEstimate:
    """Formula-based activation memory (bytes) for one rank's micro-batch; see
    activation_estimate (checked against autograd's saved tensors in the tests)."""

    tokens: int
    saved_bytes: int
    """Held from forward to backward: checkpoint inputs (or full activations of unwrapped layers)."""
    recompute_bytes: int
    """One checkpointed layer's recomputed activations (if any layer is checkpointed) + one
    layer's backward temporaries."""
    loss_bytes: int
    """Logits and the fp32 cross-entropy (log-softmax saved + its gradient)."""
    per_layer_full_bytes: int
    per_engram_layer_extra_bytes: int


@dataclass
class RankActivations:
    """Activations of this rank's stages at their peak (bytes): one micro-batch without PP, the
    micro-batches the schedule keeps in flight with PP (scripts/pipeline_memory.py)."""

    microbatch_tokens: int
    saved_bytes: int
    """Held from forward to backward at the rank's peak (all micro-batches in flight)."""
    in_flight: dict[int, int]
    """Stage index -> micro-batches whose activations are held at that peak."""
    recompute_bytes: int
    """Largest recompute + backward temporaries of one layer of this rank's stages."""
    loss_bytes: int
    """Logits and fp32 cross-entropy of one micro-batch (0 off the last stage)."""


@dataclass
class FsdpBuffers:
    """Transient FSDP buffers (bytes) from the exact unit shapes, padded as FSDP2 pads them."""

    compute_dtype: str
    reduce_dtype: str
    largest_layer: str
    layer_unsharded_params: int
    layers_reshard_after_forward: bool
    layer_gather_bytes: int
    """Largest decoder-layer unit all-gathered in the compute dtype, x2 (current + prefetch);
    every layer at once when layers do not reshard after forward (ZeRO-2-like, DDP)."""
    root_unsharded_params: int
    root_gather_bytes: int
    """Root unit (embeddings, final norm, output head) all-gathered; needed at both ends of the step."""
    layer_reduce_bytes: int
    """Largest layer: unsharded grads (compute dtype) + 2 reduce-scatter inputs (reduce dtype)."""
    root_grad_bytes: int
    """Root unit's unsharded grads (compute dtype), held until the root reduces at the end."""
    root_reduce_bytes: int
    """Root unit's reduce-scatter input (reduce dtype)."""
    no_sync_accum_bytes: int
    """Unsharded grads of every unit kept across micro-batches when the recipe skips the
    reduce-scatter on non-last micro-batches (FSDP2 set_requires_gradient_sync(False))."""


@dataclass
class ReplicatedTableBaseline:
    """Formula: bytes per rank if the Engram tables were replicated instead of row-sharded."""

    table_params_total: int
    ddp_bytes: int
    """Full table + full grad + Adam state (4 + 4 + 8 bytes per fp32 parameter)."""
    zero1_bytes: int
    """Full table + full grad, Adam state / W."""
    zero2_bytes: int
    """Full table + the full dense grad built in backward before its reduce-scatter, and the
    grad shard + Adam state / W."""
    row_sharded_bytes_max: int
    """This repo, measured: largest local table + grad + Adam over the reported ranks."""
    peak_with_ddp_tables_max: int
    """Estimated peak of the worst reported rank with DDP-replicated tables instead."""


@dataclass
class AllRanks:
    """Sums over every rank from DTensor's placement math (no rank built twice)."""

    world_size: int
    replicas: int
    """Copies of the dense model over all ranks (dp_replicate): the sum is global x replicas."""
    dense_params_sum: int
    dense_params_min: int
    dense_params_max: int
    table_rows: dict[int, list[int]]
    """Engram layer id -> rows on each rank 0..W-1."""


@dataclass
class MemoryEstimate:
    config_file: str
    model: str
    world_size: int
    parallel_dims: str
    seq_len: int
    local_batch_size: int
    grad_accum_steps: int
    activation_checkpoint: str
    training_mode: str
    global_params: int
    global_dense_params: int
    model_dim: int
    n_layers: int
    vocab_size: int
    tied_embeddings: bool
    global_table_params: int
    table_rows_global: dict[int, int]
    device_memory_bytes: int
    recipe_defers_grad_sync: bool
    no_sync_accumulation: bool
    """Modelled: unsharded gradients kept across micro-batches (the recipe's no-sync DDP
    accumulation without --sync_every_micro_batch, or a pipeline stage's micro-batches)."""
    fragmentation: float
    reserve_bytes: int
    stage_activations: list[ActivationEstimate]
    """Per pipeline stage (one entry without PP): one micro-batch's activations."""
    tp: int
    sequence_parallel: bool
    pp: int
    pipeline: str
    """"schedule, micro-batches, virtual stages" under PP, else "off"."""
    float8: str
    """float8 recipe when float8.enable, else "off"."""
    ranks: list[RankMemory]
    all_ranks: AllRanks
    replicated_tables: ReplicatedTableBaseline

    @property
    def fits(self) -> bool:
        return all(r.peak_bytes <= self.device_memory_bytes for r in self.ranks)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["fits"] = self.fits
        return out


# --------------------------------------------------------------------------- config -> model


def tokenizer_vocab_size(cfg: JobConfig) -> int:
    """The tokenizer's size as recipes/train.py passes it to build_model; the flavor's (or
    model.vocab_size) when the tokenizer file is not on this machine."""
    path = cfg.model.tokenizer_path
    if not path or Path(path).exists():
        return load_tokenizer(path).vocab_size
    flavor_vocab = cfg.model.vocab_size or flavor_args(cfg.model).vocab_size  # flavor "hf" too
    if not flavor_vocab:
        raise ConfigError(
            f"tokenizer {path} does not exist and {cfg.model.name}/{cfg.model.flavor} has no fixed "
            "vocabulary: set model.vocab_size=<rows> (or model.tokenizer_path to a tokenizer.json)"
        )
    return flavor_vocab


def build_rank_parts(
    cfg: JobConfig, dims: ParallelDims, vocab_size: int, table_rows: dict[int, int]
) -> tuple[StagePlan | None, list[int], list[nn.Module], list[nn.Parameter]]:
    """recipes/train.py's model section, on meta, for the rank of the current (fake) process
    group: build, split into this rank's pipeline stages (pp > 1), parallelize_model and
    training mode per part. Returns (plan or None, stage ids, parts, row-sharded tables)."""
    model = build_model(
        cfg.model, cfg.engram, vocab_size, table_rows, "meta", max_seq_len=cfg.training.seq_len
    )
    plan, stage_ids, parts = None, [0], [model]
    if dims.pp_enabled:
        plan, stage_ids, parts = split_stages(model, cfg, dims)
    table_params = []
    for part in parts:
        table_params += parallelize_model(part, cfg, dims)
        apply_training_mode(part, cfg.training.mode)
    return plan, stage_ids, parts, table_params


def sequence_parallel(cfg: JobConfig) -> bool:
    """parallelism.tp_sequence_parallel (default true), which the tensor-parallel work of issue 7
    adds to the config; until that lands tp is 1 and the flag changes nothing."""
    return getattr(cfg.parallelism, "tp_sequence_parallel", True)


def recipe_defers_grad_sync(cfg: JobConfig, dims: ParallelDims) -> bool:
    """Whether recipes/train.py skips the gradient reduction on non-last micro-batches (then
    those keep unsharded gradients): only under DDP, see parallelisms.fsdp.defer_grad_sync."""
    return cfg.training.grad_accum_steps > 1 and defer_grad_sync(dims)


# --------------------------------------------------------------------------- exact measurements


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_in(p: nn.Parameter, params: list[nn.Parameter]) -> bool:
    return any(p is q for q in params)


def _table_layer(
    parts: list[nn.Module], table_params: list[nn.Parameter]
) -> list[tuple[int, nn.Parameter]]:
    """(Engram layer id, table parameter) in module order, over this rank's model parts."""
    return [
        (layer, p)
        for part in parts
        for layer, block in part.engram_blocks().items()
        for p in table_params
        if p is block.table.weight
    ]


def measure_rank(
    parts: list[nn.Module],
    table_params: list[nn.Parameter],
    rank: int,
    cpu_offload: bool,
    table_optimizer: str = "adam",
    async_checkpoint: bool = False,
) -> RankMemory:
    """Exact bytes from the local shapes of this rank's parameters (all its pipeline stages)."""
    params = [p for part in parts for p in part.parameters()]
    dense = [p for p in params if not _is_in(p, table_params)]
    dense_trainable = [p for p in dense if p.requires_grad]
    tables_trainable = [p for p in table_params if p.requires_grad]
    dense_bytes = sum(_nbytes(_local(p)) for p in dense)
    dense_grad = sum(_nbytes(_local(p)) for p in dense_trainable)
    table_mem = [  # per optimizer.table_optimizer (engram/lazy_adam.py)
        table_memory_bytes(table_optimizer, *_local(p).shape, _local(p).element_size())
        for p in tables_trainable
    ]
    table_grad = sum(m["grad"] for m in table_mem)
    fp32 = _bytes("float32")
    dense_opt = ADAM_STATES * fp32 * sum(_local(p).numel() for p in dense_trainable)
    table_opt = sum(m["optimizer"] for m in table_mem)
    host = dense_bytes + dense_grad + dense_opt if cpu_offload else 0
    on_device = 0 if cpu_offload else 1
    mem = RankMemory(
        rank=rank,
        dense_params=sum(_local(p).numel() for p in dense),
        dense_param_bytes=dense_bytes,
        table_rows={layer: _local(p).shape[0] for layer, p in _table_layer(parts, table_params)},
        table_params=sum(_local(p).numel() for p in table_params),
        table_param_bytes=sum(_nbytes(_local(p)) for p in table_params),
        grad_bytes=dense_grad + table_grad,
        optimizer_bytes=dense_opt + table_opt,
        buffer_bytes=sum(_nbytes(b) for part in parts for b in part.buffers()),
        optimizer_step_temp_bytes=max(dense_grad * on_device, table_grad),
        host_bytes=host,
    )
    mem.persistent_bytes = (
        mem.dense_param_bytes + mem.table_param_bytes + mem.grad_bytes + mem.optimizer_bytes
        + mem.buffer_bytes - host
    )  # fmt: skip
    if async_checkpoint:  # what a checkpoint holds: weights and optimizer state, not gradients
        mem.async_staging_bytes = (
            mem.dense_param_bytes + mem.table_param_bytes + mem.optimizer_bytes
        )
    return mem


def _fsdp_units(model: nn.Module, table_params: list[nn.Parameter]) -> list[tuple[str, list]]:
    """(name, parameters FSDP manages in that unit), inner units first, the root last."""
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    out, claimed = [], []
    for name, module in sorted(units, key=lambda u: -len(u[0])):  # deepest name first
        own = [p for p in module.parameters() if not _is_in(p, table_params + claimed)]
        claimed.extend(own)
        out.append((name or "<root>", own))
    return out


def _fsdp_unsharded_shape(p: torch.Tensor) -> tuple[int, ...]:
    """What FSDP all-gathers of `p`: its TP-local shape (a TP-sharded dim divided by tp, as
    DTensor splits it), or the global shape without TP."""
    shape = list(p.shape)
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        for name, placement in zip(mesh.mesh_dim_names or (), p.placements, strict=True):
            if name == "tp" and placement.is_shard():
                d = placement.dim
                shape[d] = math.ceil(shape[d] / mesh.size(mesh.mesh_dim_names.index("tp")))
    return tuple(shape)


def _padded_numel(p: torch.Tensor, shard_size: int) -> int:
    """Unsharded numel of FSDP2's all-gather output: dim 0 (TP-local) padded to a multiple of the
    shard size."""
    shape = _fsdp_unsharded_shape(p)
    rows = math.ceil(shape[0] / shard_size) * shard_size if shape else 1
    return rows * math.prod(shape[1:])


def fsdp_buffers(
    cfg: JobConfig,
    dims: ParallelDims,
    parts: list[nn.Module],
    table_params: list[nn.Parameter],
    no_sync_accumulation: bool,
) -> FsdpBuffers:
    """FSDP buffers of this rank's model parts (one part, or its pipeline stages: each stage is
    its own FSDP root)."""
    fsdp_on = dims.dp_size > 1
    compute = cfg.parallelism.mixed_precision_param if fsdp_on else "float32"
    reduce = cfg.parallelism.mixed_precision_reduce if fsdp_on else "float32"
    a, r = _bytes(compute), _bytes(reduce)
    units = [u for part in parts for u in _fsdp_units(part, table_params)] if fsdp_on else []
    s = dims.dp_shard

    def unsharded(params: list, trainable_only: bool = False) -> int:
        return sum(_padded_numel(p, s) for p in params if p.requires_grad or not trainable_only)

    layers = [(n, ps) for n, ps in units if n != "<root>"]
    roots = [p for n, ps in units if n == "<root>" for p in ps]
    big_name, big = max(layers, key=lambda u: unsharded(u[1]), default=("no FSDP", []))
    # Layers that do not reshard after forward stay gathered from their forward to their
    # backward, so all of them coexist at the start of backward (under PP: all of the rank's
    # stages, kept unsharded across the micro-batches of a step).
    # torch's pipeline stage also keeps them unsharded after every backward but the last
    # (set_reshard_after_backward(False)), whatever fsdp_reshard_after_forward says.
    layer_reshard = reshard_after_forward(dims, cfg.parallelism)[0] and not dims.pp_enabled
    if layer_reshard:
        gathered = 2 * unsharded(big)  # current layer + the prefetched next one
    else:
        gathered = sum(unsharded(ps) for _, ps in layers)
    return FsdpBuffers(
        compute_dtype=compute,
        reduce_dtype=reduce,
        largest_layer=big_name,
        layer_unsharded_params=unsharded(big),
        layers_reshard_after_forward=layer_reshard,
        layer_gather_bytes=a * gathered,
        root_unsharded_params=unsharded(roots),
        root_gather_bytes=a * unsharded(roots),
        layer_reduce_bytes=(a + 2 * r) * unsharded(big, trainable_only=True),
        root_grad_bytes=a * unsharded(roots, trainable_only=True),
        root_reduce_bytes=r * unsharded(roots, trainable_only=True),
        no_sync_accum_bytes=(
            r * sum(unsharded(ps, trainable_only=True) for _, ps in units)
            if no_sync_accumulation
            else 0
        ),
    )


# --------------------------------------------------------------------------- estimates


def _norm_bytes(a: int) -> int:
    """RMSNorm, per element: the fp32 upcast (4), the normalised x in the compute dtype (a, for
    the weight multiply) and the output (a, saved by the layer that consumes it)."""
    return 4 + 2 * a


def _layer_bytes_per_token(args: ModelArgs, a: int, tp: int = 1, sp: bool = True) -> int:
    """Activations one decoder layer saves for backward, bytes per token (compute dtype `a`) on
    one of `tp` tensor-parallel ranks (`sp`: sequence parallel).

    Two RMSNorms over D (and q/k norms for Qwen3). Attention with a fused (flash) SDPA: q, and
    k, v repeated to n_heads, the output (4 a Dq), plus the fp32 log-sum-exp per head; no T x T
    scores. SwiGLU: w1 out, w3 out, silu out, product (4 a F).

    Under TP, heads and the FFN width are split (attention and FFN terms / tp). The norms run
    on the full sequence on every TP rank without sequence parallel (not divided) and on 1/tp
    of it with sequence parallel; then the column-parallel linears save their all-gathered
    input (a D for the attention and for the FFN input), which is not divided.
    """
    assert args.head_dim is not None
    dq, dkv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    # q/k norms: their output goes to RoPE, which saves only cos/sin, so no output term.
    qk_norm = (4 + a) * (dq + dkv) if args.qk_norm else 0
    attention = 4 * a * dq + 4 * args.n_heads + qk_norm
    norms = 2 * _norm_bytes(a) * args.dim
    gathered = 2 * a * args.dim if tp > 1 and sp else 0
    return (norms // tp if sp else norms) + gathered + (attention + 4 * a * args.ffn_dim) // tp


def _engram_bytes_per_token(cfg: JobConfig, dim: int, a: int) -> tuple[int, int]:
    """(saved, transient) bytes per token of an Engram block.

    Saved: the looked-up rows in the compute dtype (a E), key/query/ShortConv RMSNorms over D,
    the value projection and the conv output (2 a D), the gate scalars, and the lookup's int64
    index tensors (2 x 8 H). Transient: the all-to-all buffers (ids int64 x3, rows fp32 x3).
    """
    e = cfg.engram
    engram_dim = (e.max_ngram - 1) * e.n_embed_per_ngram
    saved = a * engram_dim + 3 * _norm_bytes(a) * dim + 2 * a * dim + 32 + 2 * 8 * e.num_heads
    return saved, 3 * 8 * e.num_heads + 3 * 4 * engram_dim


def activation_estimate(
    cfg: JobConfig,
    args: ModelArgs,
    compute_dtype: str,
    tp: int = 1,
    sp: bool = True,
    layers: list[int] | None = None,
    first: bool = True,
    last: bool = True,
    tokens: int | None = None,
) -> ActivationEstimate:
    """Activation bytes of one micro-batch on one rank, `tp` tensor-parallel ranks with (`sp`)
    or without sequence parallel. Per token, a sequence-sharded tensor costs 1/tp of its bytes:
    with sequence parallel that is the residual stream (checkpoint inputs, norms, the Engram
    block, which looks up only its own tokens); without it, only the head- and FFN-split parts.
    The loss is vocabulary-parallel under TP (loss_parallel): logits / tp.

    A pipeline stage passes its decoder `layers`, whether it is the `first` (embedding ids) and
    the `last` stage (final norm, loss) and its micro-batch `tokens` (default: the local batch)."""
    a = _bytes(compute_dtype)
    stream_div = tp if sp else 1
    if tokens is None:
        tokens = cfg.training.local_batch_size * cfg.training.seq_len
    layer_ids = range(args.n_layers) if layers is None else layers
    layer = _layer_bytes_per_token(args, a, tp, sp)
    engram_layers = set(cfg.engram.layer_ids) if cfg.engram.enabled else set()
    engram_saved, engram_transient = (
        _engram_bytes_per_token(cfg, args.dim, a) if engram_layers & set(layer_ids) else (0, 0)
    )
    engram_saved //= stream_div
    engram_transient //= stream_div
    # Embedding ids; final norm (its output feeds the head).
    saved = (8 if first else 0) + (_norm_bytes(a) * args.dim // stream_div if last else 0)
    recompute = 0
    for k, i in enumerate(layer_ids):  # AC counts the layers of the model or stage (k)
        full = layer + (engram_saved if i in engram_layers else 0)
        if is_checkpointed(cfg.activation_checkpoint, k):
            saved += a * args.dim // stream_div  # the checkpoint keeps only the layer input
            recompute = max(recompute, full)
        else:
            saved += full
    # Backward temporaries of one layer: gradients of the FFN hidden and of the stream, plus the
    # Engram lookup's all-to-all buffers.
    backward = 2 * a * args.ffn_dim // tp + 2 * a * args.dim // stream_div + engram_transient
    # Cross-entropy in fp32: log-softmax output saved, its gradient, the gradient of the fp32
    # logits (12 bytes/logit) dominate; the compute-dtype logits (a) and the fp32 upcast (4)
    # exist together with the saved log-softmax in forward (a + 8).
    loss = max(12, a + 8) * args.vocab_size // tp if last else 0
    return ActivationEstimate(
        tokens=tokens,
        saved_bytes=saved * tokens,
        recompute_bytes=(recompute + backward) * tokens,
        loss_bytes=loss * tokens,
        per_layer_full_bytes=layer * tokens,
        per_engram_layer_extra_bytes=engram_saved * tokens,
    )


def rank_activations(
    cfg: JobConfig,
    args: ModelArgs,
    compute_dtype: str,
    tp: int,
    sp: bool,
    plan: StagePlan | None,
    stage_ids: list[int],
    pp_rank: int,
    n_micro: int = 1,
) -> tuple[RankActivations, list[ActivationEstimate]]:
    """This rank's activations at its peak and every stage's one-micro-batch estimate. Without
    PP one micro-batch (the local batch) is in flight; with PP the micro-batch is local batch /
    pipeline.microbatches and in_flight walks the schedule's own order."""
    if plan is None:
        act = activation_estimate(cfg, args, compute_dtype, tp, sp)
        ra = RankActivations(
            act.tokens, act.saved_bytes, {0: 1}, act.recompute_bytes, act.loss_bytes
        )
        return ra, [act]
    p, pp = cfg.pipeline, max(plan.ranks) + 1
    tokens = cfg.training.local_batch_size // n_micro * cfg.training.seq_len
    last = plan.num_stages - 1
    per_stage = [
        activation_estimate(cfg, args, compute_dtype, tp, sp, layers, s == 0, s == last, tokens)
        for s, layers in enumerate(plan.layers)
    ]
    peak = in_flight(
        p.schedule,
        pp,
        p.virtual_stages,
        n_micro,
        pp_rank,
        {s: per_stage[s].saved_bytes for s in stage_ids},
    )
    ra = RankActivations(
        microbatch_tokens=tokens,
        saved_bytes=peak.peak_bytes,
        in_flight=peak.micro_batches,
        recompute_bytes=max(per_stage[s].recompute_bytes for s in stage_ids),
        loss_bytes=sum(per_stage[s].loss_bytes for s in stage_ids),
    )
    return ra, per_stage


def float8_cast_bytes(model: nn.Module, tokens: int, tp: int = 1) -> tuple[int, str]:
    """(bytes, linear) of the largest float8 working set of one converted linear, which exists
    only while that linear runs: torchao keeps the weight in high precision (FSDP shards and
    gathers it as usual, so no persistent byte changes) and, per matmul, casts the gathered
    weight to float8 (1 B/element, once in forward and once in backward with the other scaling
    axis) and the input / output gradient (1 B/element each, the gradient twice in backward).
    Rowwise and tensorwise alike; scales are negligible."""
    from torchao.float8.float8_linear import Float8Linear

    best, name = 0, ""
    for fqn, m in model.named_modules():
        if isinstance(m, Float8Linear):
            weight = 2 * m.in_features * m.out_features // tp  # the weight is TP-sharded
            # Under TP one of in / out is split, depending on the plan: not divided (upper bound).
            acts = tokens * (m.in_features + 2 * m.out_features)
            if weight + acts > best:
                best, name = weight + acts, clean_fqn(fqn)
    return best, name


def _phases(
    f: FsdpBuffers, act: RankActivations, opt_temp: int, float8_bytes: int = 0
) -> dict[str, int]:
    """Transient bytes at the moments that can set the peak (each a sum of coexisting items)."""
    acc = f.no_sync_accum_bytes
    return {
        "forward end (loss)": f.root_gather_bytes + act.saved_bytes + act.loss_bytes + acc,
        "decoder-layer backward": (
            f.root_gather_bytes
            + f.root_grad_bytes
            + f.layer_gather_bytes
            + act.saved_bytes
            + act.recompute_bytes
            + f.layer_reduce_bytes
            + float8_bytes
            + acc
        ),  # fmt: skip
        "backward end (root reduce)": (
            f.root_gather_bytes + f.root_grad_bytes + f.root_reduce_bytes + acc
        ),
        "optimizer step": opt_temp,
    }


# --------------------------------------------------------------------------- all ranks


# Flattened mesh views of parallelisms/parallel_dims.py and the world dims they span.
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "engram": ("dp_replicate", "dp_shard", "tp")}


def _local_shapes_by_rank(p: DTensor, world_mesh) -> dict[int, tuple[int, ...]]:
    """Global rank -> local shape of `p` on that rank, for every rank of the world: p's mesh is
    one rank's slice of the world mesh (e.g. its tp or dp_shard group); every other rank holds
    the shape of its own coordinate along the same named dims."""
    mesh = p.device_mesh
    shapes = _local_shapes(tuple(p.shape), tuple(mesh.shape), tuple(p.placements))
    wshape, wnames = tuple(world_mesh.mesh.shape), world_mesh.mesh_dim_names
    out = {}
    for idx in itertools.product(*(range(n) for n in wshape)):
        flat = 0  # row-major index of this rank's coordinate in p's mesh
        for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True):
            coord = 0
            for part in FLATTENED.get(name, (name,)):
                i = wnames.index(part)
                coord = coord * wshape[i] + idx[i]
            flat = flat * size + coord
        out[int(world_mesh.mesh[idx])] = shapes[flat]
    return out


@functools.cache
def _local_shapes(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple
) -> list[tuple[int, ...]]:
    coords = itertools.product(*(range(n) for n in mesh_shape))
    return [
        _compute_local_shape_and_global_offset(shape, mesh_shape, list(c), placements, True)[0]
        for c in coords
    ]


def stage_ranks_summary(
    parts: list[nn.Module], table_params: list[nn.Parameter], dims: ParallelDims
) -> tuple[dict[int, int], dict[int, dict[int, int]]]:
    """(rank -> dense parameters, layer -> {rank -> table rows}) for every rank that holds the
    same pipeline stages as the current one, from its placements: those ranks differ only in
    their dp / tp coordinates (without PP: every rank of the world)."""
    world_mesh = dims.mesh()
    pp_coord = dims.mesh("pp").get_local_rank()
    same_stage = {int(r) for r in world_mesh.mesh[pp_coord].flatten()}
    dense = dict.fromkeys(same_stage, 0)
    for part in parts:
        for p in part.parameters():
            if _is_in(p, table_params):
                continue
            if not isinstance(p, DTensor):  # no FSDP / TP: every rank of the stage holds it whole
                dense = {r: n + p.numel() for r, n in dense.items()}
                continue
            for rank, shape in _local_shapes_by_rank(p, world_mesh).items():
                if rank in same_stage:
                    dense[rank] += math.prod(shape)
    rows = {}
    for layer, p in _table_layer(parts, table_params):
        if isinstance(p, DTensor):
            by_rank = _local_shapes_by_rank(p, world_mesh)
            rows[layer] = {r: by_rank[r][0] for r in same_stage}
        else:
            rows[layer] = dict.fromkeys(same_stage, p.shape[0])
    return dense, rows


def all_ranks_summary(
    summaries: list[tuple[dict[int, int], dict[int, dict[int, int]]]], dims: ParallelDims
) -> AllRanks:
    """Merge the stage summaries (one built rank per pp coordinate) into every rank's numbers."""
    world = dims.world_size
    dense = [0] * world
    rows: dict[int, list[int]] = {}
    for stage_dense, stage_rows in summaries:
        for r, n in stage_dense.items():
            dense[r] += n
        for layer, by_rank in stage_rows.items():
            per_rank = rows.setdefault(layer, [0] * world)
            for r, n in by_rank.items():
                per_rank[r] += n
    rows = dict(sorted(rows.items()))
    return AllRanks(world, dims.dp_replicate, sum(dense), min(dense), max(dense), rows)


# --------------------------------------------------------------------------- driver


def default_ranks(world_size: int) -> list[int]:
    return sorted({0, min(1, world_size - 1), world_size // 2, world_size - 1})


def estimate(
    cfg: JobConfig,
    world_size: int,
    ranks: list[int] | None = None,
    device_memory_gib: float | None = None,
    fragmentation: float = 0.10,
    reserve_gib: float = 3.0,
    sync_every_micro_batch: bool = False,
) -> MemoryEstimate:
    """Build the config's model for each rank in `ranks` under a fake process group of
    `world_size` and return exact per-rank bytes plus the labelled estimates.

    `sync_every_micro_batch` models a recipe that reduce-scatters after every micro-batch
    instead of recipes/train.py's no-sync gradient accumulation."""
    if dist.is_initialized():
        raise RuntimeError(
            "estimate() plays every rank under its own fake process group: call it in a process "
            "without an initialised process group"
        )
    if world_size < 1:
        raise ConfigError(f"--world_size must be >= 1, got {world_size}")
    ranks = default_ranks(world_size) if ranks is None else sorted(set(ranks))
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"ranks {bad} are outside 0..{world_size - 1} (--ranks)")
    if device_memory_gib is None:
        device_memory_gib = DEVICE_MEMORY_GIB.get(cfg.job.device, 64.0)
    if cfg.float8.enable:
        # The recipe's "float8 without compile is slow" warning would repeat once per rank here.
        logging.getLogger("parallelisms.float8").setLevel(logging.ERROR)
        # npu is refused exactly as in training; on the fake CPU mesh torchao must emulate
        # (the per-rank bytes are the same: Float8Linear keeps high-precision weights).
        if cfg.job.device == "npu":
            check_float8_device(cfg.float8, "npu")
        cfg = dataclasses.replace(cfg, float8=dataclasses.replace(cfg.float8, emulate=True))
    dims = parallel_dims_from_config(cfg, world_size)  # validates the degrees up front
    # Unsharded gradients kept across micro-batches: the recipe's no-sync DDP accumulation, or
    # a pipeline stage (torch's stage turns gradient sync off for all but the last micro-batch).
    n_micro = (
        check_schedule(cfg.pipeline, dims.pp, cfg.training.local_batch_size)
        if dims.pp_enabled
        else 1
    )
    pp_micro = n_micro > 1
    no_sync = (recipe_defers_grad_sync(cfg, dims) and not sync_every_micro_batch) or pp_micro
    table_rows = engram_table_rows(cfg.engram)
    vocab_size = tokenizer_vocab_size(cfg)
    whole = build_model(
        cfg.model, cfg.engram, vocab_size, table_rows, "meta", max_seq_len=cfg.training.seq_len
    )
    n_global = sum(p.numel() for p in whole.parameters())
    n_tables = sum(b.table.weight.numel() for b in whole.engram_blocks().values())
    # One built rank per pipeline coordinate gives every rank's numbers (all_ranks_summary).
    per_stage = world_size // dims.pp
    representatives = {c * per_stage for c in range(dims.pp)}

    results: list[RankMemory] = []
    summaries, stage_acts = [], []
    for rank in sorted(set(ranks) | representatives):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            dims = parallel_dims_from_config(cfg, world_size)
            dims.build_mesh("cpu")
            plan, stage_ids, parts, table_params = build_rank_parts(
                cfg, dims, vocab_size, table_rows
            )
            if rank in representatives:
                summaries.append(stage_ranks_summary(parts, table_params, dims))
            if rank in ranks:
                mem = measure_rank(
                    parts,
                    table_params,
                    rank,
                    cfg.parallelism.cpu_offload,
                    cfg.optimizer.table_optimizer,
                    async_checkpoint=cfg.checkpoint.enable and cfg.checkpoint.async_mode == "async",
                )
                mem.stages = stage_ids
                mem.stage_layers = (
                    {s: plan.layers[s] for s in stage_ids}
                    if plan
                    else {0: list(range(whole.args.n_layers))}
                )
                mem.fsdp = fsdp_buffers(cfg, dims, parts, table_params, no_sync)
                mem.activations, acts = rank_activations(
                    cfg,
                    whole.args,
                    mem.fsdp.compute_dtype,
                    dims.tp,
                    sequence_parallel(cfg),
                    plan,
                    stage_ids,
                    dims.mesh("pp").get_local_rank(),
                    n_micro,
                )
                stage_acts = stage_acts or acts
                if cfg.float8.enable:
                    mem.float8_cast_bytes, mem.float8_largest_linear = max(
                        float8_cast_bytes(part, mem.activations.microbatch_tokens, dims.tp)
                        for part in parts
                    )
                mem.comm = comm_per_step(cfg, dims, parts, table_params, mem, plan)
                results.append(mem)
        finally:
            dist.destroy_process_group()
    all_ranks = all_ranks_summary(summaries, dims)

    device_bytes = int(device_memory_gib * GIB)
    reserve = int(reserve_gib * GIB)
    for mem in results:
        mem.phases = _phases(
            mem.fsdp, mem.activations, mem.optimizer_step_temp_bytes, mem.float8_cast_bytes
        )
        mem.peak_phase = max(mem.phases, key=mem.phases.__getitem__)
        mem.transient_bytes = mem.phases[mem.peak_phase]
        mem.fragmentation_bytes = int(fragmentation * (mem.persistent_bytes + mem.transient_bytes))
        mem.reserve_bytes = reserve
        mem.peak_bytes = (
            mem.persistent_bytes + mem.transient_bytes + mem.fragmentation_bytes + reserve
        )
        mem.headroom_bytes = device_bytes - mem.peak_bytes

    table_state = [m.table_param_bytes * (1 + 1 + ADAM_STATES) for m in results]
    worst = max(results, key=lambda m: m.peak_bytes)
    # Replicated tables: the tables of the worst rank's stages (all tables without PP) on every
    # rank of its stage; the sharded table state leaves, the full one arrives; the rest scales
    # with the allocator fragmentation the same way.
    width = n_tables // sum(table_rows.values()) if table_rows else 0
    stage_tables = width * sum(table_rows[layer] for layer in worst.table_rows)
    full = 4 * stage_tables  # fp32 bytes
    ddp = full * (1 + 1 + ADAM_STATES)
    stage_world = world_size // dims.pp
    worst_table = worst.table_param_bytes * (1 + 1 + ADAM_STATES)
    baseline = ReplicatedTableBaseline(
        table_params_total=stage_tables,
        ddp_bytes=ddp,
        zero1_bytes=2 * full + ADAM_STATES * full // stage_world,
        zero2_bytes=2 * full + (1 + ADAM_STATES) * full // stage_world,
        row_sharded_bytes_max=max(table_state),
        peak_with_ddp_tables_max=worst.peak_bytes + int((1 + fragmentation) * (ddp - worst_table)),
    )
    return MemoryEstimate(
        config_file=cfg.job.config_file,
        model=f"{cfg.model.name}/{cfg.model.flavor}",
        world_size=world_size,
        parallel_dims=repr(dims),
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        grad_accum_steps=cfg.training.grad_accum_steps,
        activation_checkpoint=cfg.activation_checkpoint.mode,
        training_mode=cfg.training.mode,
        global_params=n_global,
        global_dense_params=n_global - n_tables,
        model_dim=whole.args.dim,
        n_layers=whole.args.n_layers,
        vocab_size=whole.args.vocab_size,
        tied_embeddings=whole.args.tie_embeddings,
        global_table_params=n_tables,
        table_rows_global=dict(table_rows),
        device_memory_bytes=device_bytes,
        recipe_defers_grad_sync=recipe_defers_grad_sync(cfg, dims),
        no_sync_accumulation=no_sync,
        fragmentation=fragmentation,
        reserve_bytes=reserve,
        stage_activations=stage_acts,
        tp=dims.tp,
        sequence_parallel=sequence_parallel(cfg),
        pp=dims.pp,
        pipeline=(
            f"{cfg.pipeline.schedule}, {n_micro} micro-batches, "
            f"{cfg.pipeline.virtual_stages} stage(s) per rank"
            if dims.pp_enabled
            else "off"
        ),
        float8=cfg.float8.recipe if cfg.float8.enable else "off",
        ranks=results,
        all_ranks=all_ranks,
        replicated_tables=baseline,
    )


# --------------------------------------------------------------------------- report


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
)


FSDP_ROWS = (
    ("all-gather root unit(s), GiB", "root_gather_bytes"),
    ("layer grads + 2 reduce-scatter inputs, GiB", "layer_reduce_bytes"),
    ("root grads (held to end of backward), GiB", "root_grad_bytes"),
    ("root reduce-scatter input, GiB", "root_reduce_bytes"),
)


def _span(layers: list[int]) -> str:
    return f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"


def to_markdown(est: MemoryEstimate) -> str:
    rs = est.ranks
    f0 = rs[0].fsdp
    cols = " | ".join(f"rank {m.rank}" for m in rs)
    lines = [
        f"## {est.model} at world {est.world_size} ({est.config_file or 'defaults'})",
        "",
        f"{est.parallel_dims}; seq_len {est.seq_len}, local batch {est.local_batch_size}, "
        f"grad accum {est.grad_accum_steps}, activation checkpointing {est.activation_checkpoint}, "
        f"training mode {est.training_mode}; compute {f0.compute_dtype}, reduce "
        f"{f0.reduce_dtype}; float8 {est.float8}"
        + (f"; tp {est.tp}, sequence parallel {est.sequence_parallel}" if est.tp > 1 else "")
        + (f"; pipeline {est.pipeline}" if est.pp > 1 else "")
        + ". GiB = 2^30 bytes.",
        "",
        f"| per rank | {cols} | kind |",
        "| --- | " + " | ".join("---:" for _ in rs) + " | --- |",
    ]

    def row(label: str, values: list[str], kind: str) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + f" | {kind} |")

    def each(fn) -> list[str]:
        return [fn(m) for m in rs]

    if est.pp > 1:
        row(
            "pipeline stages (decoder layers)",
            each(lambda m: ", ".join(f"{s} ({_span(m.stage_layers[s])})" for s in m.stages)),
            "exact",
        )
    row("dense parameters (FSDP shard), count", [_count(m.dense_params) for m in rs], "exact")
    row(
        "dense parameters fp32 = master weights, GiB",
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
    if any(m.host_bytes for m in rs):
        row("- of which on the host (cpu_offload), GiB", [_gib(m.host_bytes) for m in rs], "exact")
    row("**persistent on device**, GiB", [f"**{_gib(m.persistent_bytes)}**" for m in rs], "exact")
    if any(m.async_staging_bytes for m in rs):
        row(
            "async checkpoint staging copy (host memory, not device), GiB",
            [_gib(m.async_staging_bytes) for m in rs],
            "exact",
        )
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
    for label, key in COMM_ROWS:
        row(
            f"{label}, GiB received per step",
            each(lambda m, k=key: _gib(getattr(m.comm, k))),
            "formula",
        )
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
            f"({_gib(f0.no_sync_accum_bytes)} GiB on rank {rs[0].rank}).",
        ]
    a = est.all_ranks
    rows_summary = "; ".join(f"layer {layer}: {_runs(r)}" for layer, r in a.table_rows.items())
    lines += [
        "",
        "### All ranks (DTensor placement math from one built rank per pipeline stage)",
        "",
        f"- dense parameters summed over {a.world_size} ranks: {_count(a.dense_params_sum)} "
        f"(global {_count(est.global_dense_params)} x {a.replicas} replica(s)); per rank min "
        f"{_count(a.dense_params_min)}, "
        f"max {_count(a.dense_params_max)}",
        f"- Engram table rows: {rows_summary or 'no Engram tables'}",
        "",
        "### Replicated-table baselines (formula, fp32 tables, Adam)",
        "",
        "| Engram table state per rank | GiB |",
        "| --- | ---: |",
    ]
    b = est.replicated_tables
    lines += [
        f"| DDP: full table + full grad + Adam (16 B/param x {_count(b.table_params_total)}) | {_gib(b.ddp_bytes)} |",
        f"| ZeRO-1: full table + full grad, Adam / {est.world_size} | {_gib(b.zero1_bytes)} |",
        f"| ZeRO-2: full table + full dense grad in backward, grad shard and Adam / {est.world_size} | {_gib(b.zero2_bytes)} |",
        f"| row-sharded (this repo, measured, worst reported rank) | {_gib(b.row_sharded_bytes_max)} |",
        f"| estimated peak of the worst rank with DDP-replicated tables | {_gib(b.peak_with_ddp_tables_max)} |",
    ]
    n_rows = sum(est.table_rows_global.values())
    dim = est.global_table_params // n_rows if n_rows else 0
    lines += table_memory_markdown(est.table_rows_global, dim, est.world_size // est.pp)
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description="Fake-backend dry run: per-rank memory of a config at its real world size. "
        "Other arguments (--job.config_file PATH, --section.key=value) go to the job config."
    )
    p.add_argument("--world_size", type=int, required=True, help="processes (NNODES x NGPU)")
    p.add_argument(
        "--ranks", default="", help="comma-separated ranks, or 'all' (default: 0,1,W/2,W-1)"
    )
    p.add_argument(
        "--device_memory_gib",
        type=float,
        default=None,
        help="device memory; default 64 for job.device npu, 80 for cuda, else 64",
    )
    p.add_argument("--fragmentation", type=float, default=0.10, help="allocator overhead fraction")
    p.add_argument(
        "--reserve_gib", type=float, default=3.0, help="runtime context + HCCL/NCCL buffers"
    )
    p.add_argument(
        "--sync_every_micro_batch",
        action="store_true",
        help="model reduce-scatter after every micro-batch instead of the recipe's no-sync "
        "gradient accumulation",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    p.add_argument(
        "--compare",
        action="store_true",
        help="print candidate layouts side by side (scripts/compare_layouts.py) instead",
    )
    p.add_argument(
        "--layouts",
        default="",
        help="with --compare: comma-separated layouts, e.g. FSDP64,HSDP8x8,PP2xTP4xFSDP8 "
        "(default: the usual candidates for the world size)",
    )
    p.add_argument(
        "--node_size", type=int, default=8, help="with --compare: devices per node (TP <= this)"
    )
    p.add_argument(
        "--local_batch_sizes",
        default="",
        help="with --compare: micro-batch sizes (sequences) to try for layouts without PP, e.g. "
        "1,2,4 (default: the config's training.local_batch_size)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=0.15,
        help="with --compare: the pick needs this fraction of device memory free",
    )
    for flag, what in (
        ("peak_tflops", "dense bf16 TFLOPS per device"),
        ("mfu", "model FLOPs utilisation"),
        ("inter_node_gbs", "GB/s per device between nodes"),
        ("intra_node_gbs", "GB/s per device inside a node"),
    ):
        p.add_argument(
            f"--{flag}", type=float, default=None, help=f"with --compare: {what} (step model)"
        )
    return p.parse_known_args(argv)


def _parse_ranks(text: str, world_size: int) -> list[int] | None:
    if not text:
        return None
    if text == "all":
        return list(range(world_size))
    try:
        return [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(
            f"--ranks must be comma-separated integers or 'all', got {text!r}"
        ) from None


def main(argv: list[str] | None = None) -> MemoryEstimate | list:
    opts, rest = parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = load_config(rest)
    if opts.compare:
        from scripts import compare_layouts

        machine = compare_layouts.MACHINES.get(cfg.job.device, compare_layouts.MACHINES["cuda"])
        machine = dataclasses.replace(
            machine,
            **{
                k: getattr(opts, k)
                for k in ("peak_tflops", "mfu", "inter_node_gbs", "intra_node_gbs")
                if getattr(opts, k) is not None
            },
        )
        rows = compare_layouts.compare(
            cfg,
            opts.world_size,
            [name for name in opts.layouts.split(",") if name] or None,
            opts.node_size,
            machine,
            [int(n) for n in opts.local_batch_sizes.split(",") if n] or None,
            device_memory_gib=opts.device_memory_gib,
            fragmentation=opts.fragmentation,
            reserve_gib=opts.reserve_gib,
        )
        print(
            compare_layouts.to_markdown(
                cfg, opts.world_size, rows, opts.node_size, machine, opts.margin
            )
        )
        return rows
    est = estimate(
        cfg,
        opts.world_size,
        _parse_ranks(opts.ranks, opts.world_size),
        opts.device_memory_gib,
        opts.fragmentation,
        opts.reserve_gib,
        opts.sync_every_micro_batch,
    )
    print(json.dumps(est.to_dict(), indent=2) if opts.json else to_markdown(est))
    return est


if __name__ == "__main__":
    main()
