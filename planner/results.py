"""Result types of the memory planner: one rank's exact and estimated bytes, its FSDP buffers,
activations and communication, and the whole estimate (what --json prints)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from parallelisms.fsdp import DTYPES
from planner.tier_results import NvmeTier, TableCheckpoint

GIB = 1024**3


def dtype_bytes(dtype_name: str) -> int:
    """Bytes per element of a parallelism.mixed_precision_* dtype (parallelisms/fsdp.py's table)."""
    return DTYPES[dtype_name].itemsize


# exp_avg + exp_avg_sq, fp32, same local shape as the parameter (AdamW and LazyAdam alike).
ADAM_STATES = 2


@dataclass
class CommPerStep:
    """Bytes this rank receives per optimizer step."""

    fsdp_all_gather: int = 0
    fsdp_reduce_scatter: int = 0
    dp_all_reduce: int = 0
    tp: int = 0
    pp_send_recv: int = 0
    table_all_to_all: int = 0
    cp: int = 0
    """Context parallelism: attention's all-to-all (Ulysses) or K / V all-gather and gradient
    reduce-scatter (all-gather K/V) over cp, plus the Engram ShortConv halo over cp x tp."""

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


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
    """AdamW / LazyAdam: exp_avg + exp_avg_sq per trainable parameter, fp32."""
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
    host_table_bytes: int = 0
    """engram.table_location = host: this rank's table shards + row-sparse optimizer state +
    staging buffers, in host memory (exact shapes; staging <= 64 MiB per table)."""
    host_table_device_bytes: int = 0
    """engram.table_location = host, estimate: device bytes of one micro-batch's looked-up rows
    (the owner's gathered rows + the rows brought back, held until backward), all host tables:
    2 x lookup ids x head_dim x param bytes."""
    host_link_bytes: int = 0
    """engram.table_location = host, estimate: host <-> device bytes per optimizer step (rows
    gathered on the host to the device + fp32 row gradients and int64 row ids back), upper bound
    of one row per lookup id."""
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
    cp_mask_bytes: int = 0
    """parallelism.cp_method = allgather_kv: the attention masks every attention module caches
    (bool [T / cp, T] each, planner.activations.cp_mask_bytes); counted in persistent_bytes."""
    grads_freed_at_loss: bool = False
    """The gradients (grad_bytes) do not exist yet when the loss's backward runs: the previous
    step cleared them (zero_grad(set_to_none=True), engram/train/step.py step_optimizers) and
    this step's first backward has not reached a parameter. True with one micro-batch per
    optimizer step (no accumulation, no pipeline micro-batches); the loss phase leaves them out."""
    workspace_bytes: int = 0
    """Allowance for the device runtime's workspaces and the step's small tensors, in every phase
    (planner.estimate.RUNTIME_WORKSPACE_GIB; 0 on cpu)."""


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
    held_output_bytes: int = 0
    """The model's output (logits, or the hidden states with training.loss_chunks > 1), which the
    step holds until backward ends (engram/train/step.py forward_backward keeps `output`)."""


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
    held_output_bytes: int = 0
    """The last stage's output held through backward (ActivationEstimate.held_output_bytes)."""


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
    table_location: str = "device"
    ranks_per_node: int = 8
    host_memory_bytes: int = 0
    """Host memory per node the host tables may use (engram.host_memory_gib or --host_memory_gib;
    0: not stated, not checked)."""
    host_link_gbs: float = 0.0
    """Assumed host <-> device GB/s per device (--host_link_gbs)."""
    cp: int = 1
    cp_method: str = "ulysses"
    nvme: NvmeTier | None = None
    """engram.table_location = nvme: the drives, host cache and I/O per node, else None."""
    table_checkpoint: TableCheckpoint | None = None
    """Engram tables off the device: planner.table_checkpoint.TableCheckpoint, else None."""

    @property
    def host_table_bytes_per_node(self) -> int:
        return max((r.host_table_bytes for r in self.ranks), default=0) * self.ranks_per_node

    @property
    def host_fits(self) -> bool:
        return (
            not self.host_memory_bytes or self.host_table_bytes_per_node <= self.host_memory_bytes
        )

    @property
    def fits(self) -> bool:
        device = all(r.peak_bytes <= self.device_memory_bytes for r in self.ranks)
        return device and self.host_fits and not (self.nvme and self.nvme.problems)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["fits"] = self.fits
        out["host_table_bytes_per_node"] = self.host_table_bytes_per_node
        return out
