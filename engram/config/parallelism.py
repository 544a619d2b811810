"""Config sections that say how the model is placed on ranks and run: `[parallelism]`,
`[pipeline]`, `[activation_checkpoint]`, `[float8]`, `[compile]`, `[deepspeed]`, `[comm]`."""

from __future__ import annotations

from dataclasses import dataclass, field

from engram.config.checks import check

CP_METHODS = ("ulysses", "allgather_kv")


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """Data-parallel replicas (DDP across replicas; HSDP when dp_shard > 1 too)."""
    dp_shard: int = -1
    """FSDP2 shard degree. -1: all ranks left after dp_replicate, tp and pp."""
    tp: int = 1
    """Tensor parallel degree (innermost mesh axis: keep it within a node)."""
    pp: int = 1
    """Pipeline parallel degree (stages over ranks; see the [pipeline] section)."""
    cp: int = 1
    """Context parallel degree: the ranks of one data-parallel replica that split each sample's
    sequence (parallelisms/context_parallel.py; docs/parallelisms.md "Context parallelism")."""
    cp_method: str = "ulysses"
    """How attention sees the whole sequence under cp > 1: ulysses (all-to-all from sequence- to
    head-sharded q / k / v and back; query and KV heads divisible by tp x cp) | allgather_kv
    (each rank keeps its queries and all-gathers K and V; load-balanced chunks, any head count)."""
    fsdp_reshard_after_forward: str = "default"
    """always (ZeRO-3-like) | never (ZeRO-2-like) | default (always, except the root; never at
    shard size 1, DDP or one dp rank, where the unsharded copies are local casts)."""
    engram_table_dedup: bool = True
    """De-duplicate hash ids before the all-to-all of the sharded table lookup."""
    engram_a2a_dtype: str = ""
    """Dtype of the table rows and row gradients in the lookup's all-to-all: "" (the table's
    dtype), float32 or bfloat16 (half the bytes; the table and its optimizer stay fp32)."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer state (ZeRO-Offload)."""
    mixed_precision_param: str = "float32"
    """Compute dtype of parameters at every layout (FSDP2's MixedPrecisionPolicy, on a 1-rank
    mesh without data parallelism; master weights and optimizer state stay fp32): float32 |
    bfloat16."""
    mixed_precision_reduce: str = "float32"
    """Gradient reduction dtype (FSDP2's MixedPrecisionPolicy): float32 | bfloat16."""
    # --- tensor parallelism; degrees are checked by parallelisms/parallel_dims.py
    tp_sequence_parallel: bool = True
    """Under TP, shard norms and the residual stream along the sequence (Engram blocks run
    sequence-sharded either way)."""
    tp_loss_parallel: bool = True
    """Under TP, keep logits vocabulary-sharded and compute the loss under loss_parallel()."""

    def __post_init__(self) -> None:
        check(
            self.fsdp_reshard_after_forward in ("always", "never", "default"),
            "parallelism.fsdp_reshard_after_forward must be always, never or default",
        )
        for name in ("mixed_precision_param", "mixed_precision_reduce"):
            check(
                getattr(self, name) in ("float32", "bfloat16"),
                f"parallelism.{name} must be float32 or bfloat16",
            )
        check(self.cp >= 1, f"parallelism.cp must be >= 1, got {self.cp}")
        check(
            self.cp_method in CP_METHODS,
            f"parallelism.cp_method must be one of {', '.join(CP_METHODS)}, got {self.cp_method!r}",
        )
        check(
            self.engram_a2a_dtype in ("", "float32", "bfloat16"),
            'parallelism.engram_a2a_dtype must be "" (the table dtype), float32 or bfloat16, '
            f"got {self.engram_a2a_dtype!r}",
        )


# --- pipeline parallelism; parallelisms/pipeline.py checks the split against the model
PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)


@dataclass
class Pipeline:
    schedule: str = "1F1B"
    """GPipe | 1F1B (one stage per rank) | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble
    (virtual_stages >= 2) | ZBVZeroBubble | DualPipeV ("v" placement, virtual_stages = 2)."""
    microbatches: int = 0
    """Micro-batches per local batch (must divide training.local_batch_size); 0: one per stage."""
    virtual_stages: int = 1
    """Stages per pipeline rank (looped and V schedules need >= 2)."""
    layers_per_stage: int = 0
    """Decoder layers per stage (the last stage takes the rest); 0: split evenly."""
    split_points: list[str] = field(default_factory=list)
    """Explicit first layer of every stage but the first, e.g. ["layers.3"]; overrides the above."""

    def __post_init__(self) -> None:
        check(
            self.schedule in PIPELINE_SCHEDULES,
            f"pipeline.schedule must be one of {', '.join(PIPELINE_SCHEDULES)}",
        )
        check(self.microbatches >= 0, "pipeline.microbatches must be >= 0 (0: one per stage)")
        check(self.virtual_stages >= 1, "pipeline.virtual_stages must be >= 1")
        check(self.layers_per_stage >= 0, "pipeline.layers_per_stage must be >= 0")


@dataclass
class ActivationCheckpoint:
    mode: str = "none"
    """none | full (every decoder layer) | selective (every selective_every-th layer)."""
    selective_every: int = 2

    def __post_init__(self) -> None:
        check(
            self.mode in ("none", "full", "selective"),
            "activation_checkpoint.mode must be none, full or selective",
        )
        check(self.selective_every >= 1, "activation_checkpoint.selective_every must be >= 1")


FLOAT8_RECIPES = ("rowwise", "tensorwise", "rowwise_with_gw_hp")


@dataclass
class Float8:
    enable: bool = False
    """float8 matmuls in the decoder's linears through torchao (`pip install -e ".[float8]"`);
    needs CUDA compute capability >= 8.9 (H100 / L40S class) or emulate. Not on npu (910B / 910C
    have no float8 matmul: use bf16)."""
    recipe: str = "rowwise"
    """torchao recipe: rowwise (per-row scales, torchao's recommendation) | tensorwise |
    rowwise_with_gw_hp (rowwise, weight gradient in high precision)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "engram."])
    """Linears whose name contains any of these stay in high precision (default: the output
    head and the Engram projections). Engram tables are embeddings and are never float8."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision (CPU tests; numerics only, no speed-up)."""

    def __post_init__(self) -> None:
        check(
            self.recipe in FLOAT8_RECIPES,
            f"float8.recipe must be one of {', '.join(FLOAT8_RECIPES)}, got {self.recipe!r}",
        )


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each decoder block (the Engram table lookup stays eager)."""
    backend: str = "inductor"
    """torch.compile backend: inductor | aot_eager | eager (the last two for debugging)."""
    allow_on_npu: bool = False
    """Opt in to compile on npu (refused by default: on Ascend 910B the backward graph fails
    after ~30 min of compiling, triton-lang/triton-ascend#424; eager works). For testing a
    newer triton-ascend / torch_npu; the run then warns once. docs/npu.md."""

    def __post_init__(self) -> None:
        check(bool(self.backend), "compile.backend must not be empty (e.g. inductor)")

    def check_device(self, device_type: str) -> str | None:
        """Refuse compile on npu unless allowed; return the warning to log when allowed there."""
        if not (self.enable and device_type == "npu"):
            return None
        check(
            self.allow_on_npu,
            "compile.enable = true on npu: on Ascend 910B the backward graph fails after ~30 min "
            "of compiling (triton-lang/triton-ascend#424, torch / torch_npu 2.10, CANN 8.5) while "
            "eager works; set compile.enable = false, or compile.allow_on_npu = true to test a "
            "newer triton-ascend (docs/npu.md)",
        )
        return (
            "compile.enable = true on npu (compile.allow_on_npu): not shown to work on Ascend; "
            "the backward graph failed to compile on 910B (triton-lang/triton-ascend#424)"
        )


@dataclass
class DeepSpeed:
    """Read by recipes/train_deepspeed.py only (the main recipe does not use DeepSpeed)."""

    zero_stage: int = 2
    """DeepSpeed ZeRO stage of the dense model: 1 (optimizer state sharded), 2 (+ gradients),
    3 (+ parameters). The Engram tables stay outside the engine, row-sharded as in train.py."""
    offload_optimizer: str = "none"
    """none | cpu: ZeRO-Offload of the optimizer state (and its step) to host memory."""
    offload_param: str = "none"
    """none | cpu: ZeRO-3 parameter offload to host memory (zero_stage = 3 only)."""
    config_json: str = ""
    """Path to an existing ds_config.json merged into the generated one; a setting it shares
    with this TOML must agree (docs/deepspeed.md lists the mapping)."""

    def __post_init__(self) -> None:
        check(
            self.zero_stage in (1, 2, 3),
            f"deepspeed.zero_stage must be 1, 2 or 3, got {self.zero_stage} (stage 0 is plain "
            "data parallel: use recipes/train.py)",
        )
        for name in ("offload_optimizer", "offload_param"):
            check(
                getattr(self, name) in ("none", "cpu"),
                f"deepspeed.{name} must be none or cpu, got {getattr(self, name)!r} (NVMe "
                "offload is not wired in this recipe)",
            )
        check(
            self.offload_param == "none" or self.zero_stage == 3,
            f"deepspeed.offload_param = {self.offload_param!r} needs deepspeed.zero_stage = 3 "
            f"(got {self.zero_stage}): only ZeRO-3 partitions parameters",
        )


@dataclass
class Comm:
    """Process-group timeouts (torchtitan's `[comm]` init / train timeouts, in seconds).

    Both must outlast the longest legitimate wait in a collective: every rank blocks there while
    the slowest one reads or writes its checkpoint shard. A 32B full-state checkpoint (fp32
    weights + two Adam moments: 12 B x 32.8B = 393 GB) read or written by 64 ranks at once at
    200 MB/s aggregate (a slow shared file system) takes ~33 min, so 3600 s leaves margin; the
    Ascend MindSpeed recipes also use 3600 (torchtitan's 300 / 100 assume a fast parallel file
    system and time such a job out). On npu the larger of the two also becomes HCCL_EXEC_TIMEOUT
    when that is unset (HCCL's own 1800 s default would abort first)."""

    init_timeout_s: int = 3600
    """Timeout of every process group from creation through the first training step: model
    build, HF / checkpoint load, the first step (compile, first all-gathers)."""
    train_timeout_s: int = 3600
    """Timeout set on every process group after the first step (torch's `_set_pg_timeout`,
    gloo and nccl). Lower it to find a hung rank sooner when saves are fast. hccl cannot change
    it after creation: on npu the groups keep max(init_timeout_s, train_timeout_s)."""

    def __post_init__(self) -> None:
        for name in ("init_timeout_s", "train_timeout_s"):
            check(
                getattr(self, name) > 0,
                f"comm.{name} must be > 0 seconds, got {getattr(self, name)} (a 32B checkpoint "
                "load / save on 64 ranks needs ~3600)",
            )
