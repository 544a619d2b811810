"""The typed job configuration: one dataclass per TOML section, every field documented, checked
in `__post_init__` (reading TOML and overrides: engram/config/loading.py).

Every field carries its documentation. An unknown section or key, a value of the wrong type, or
an inconsistent combination is an error that names the fix; nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engram.config.table_optimizers import TABLE_OPTIMIZERS

# Largest n-gram order of the C hashing kernel (MAX_NGRAM in engram/hashing/csrc/ngram_hash.c).
MAX_NGRAM = 16

# Where the Engram table shards and their optimizer state live (parallelisms/engram_tables/host.py).
TABLE_LOCATIONS = ("device", "host")


class ConfigError(ValueError):
    """A configuration problem; the message says how to fix it."""


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_finite(value: float, key: str, hint: str = "") -> None:
    """NaN compares false with everything and inf passes `> 0`: reject both by name."""
    check(math.isfinite(value), f"{key} must be a finite number, got {value!r} {hint}".rstrip())


@dataclass
class Job:
    config_file: str = ""
    """TOML file this config was read from (set by --job.config_file)."""
    dump_folder: str = "./outputs"
    """Root folder for all run outputs."""
    run_name: str = "debug"
    """Sub-folder of dump_folder for this run: TensorBoard events, metrics.jsonl, checkpoints."""
    description: str = ""
    seed: int = 0
    """Seed for weight initialisation and data order (same weights at every parallel layout)."""
    device: str = "auto"
    """auto | cpu | cuda | npu. auto picks cuda, then npu, then cpu."""
    deterministic: bool = False
    """Ask torch for deterministic kernels (slower)."""

    def __post_init__(self) -> None:
        check(
            self.device in ("auto", "cpu", "cuda", "npu"),
            f"job.device must be auto, cpu, cuda or npu, got {self.device!r}",
        )
        check(bool(self.run_name), "job.run_name must not be empty")
        check(
            not Path(self.run_name).is_absolute() and ".." not in Path(self.run_name).parts,
            f"job.run_name = {self.run_name!r} must stay inside job.dump_folder: a relative "
            "name without '..' (e.g. 'exp1' or 'sweeps/exp1'); move the output root with "
            "job.dump_folder",
        )


@dataclass
class Model:
    name: str = "llama3"
    """Architecture family: llama3 | qwen2 | qwen3 (see engram/models/args.py)."""
    flavor: str = "debug"
    """Shape within the family, e.g. debug, 8B, 32B."""
    tokenizer_path: str = ""
    """Path to a HF tokenizer.json. Empty: the debug tokenizer shipped in engram/data/assets."""
    vocab_size: int = 0
    """Embedding rows. 0: the flavor's vocab size, or the tokenizer's size for debug flavors."""
    hf_checkpoint: str = ""
    """HF checkpoint folder (*.safetensors, Llama/Qwen names) to initialise the backbone from on
    a fresh run; Engram parameters keep their own init. Empty: random init."""
    hf_config_mismatch: str = "error"
    """error | warn: what a named flavor that differs from hf_checkpoint's config.json does
    (flavor = "hf" takes the shape from config.json instead)."""

    def __post_init__(self) -> None:
        check(
            self.name in ("llama3", "qwen2", "qwen3"),
            f"model.name {self.name!r} is not one of llama3, qwen2, qwen3",
        )
        check(
            self.vocab_size >= 0,
            "model.vocab_size must be >= 0 (0 = take it from the flavor/tokenizer)",
        )
        check(
            self.flavor != "hf" or bool(self.hf_checkpoint),
            'model.flavor = "hf" reads the shape from config.json in model.hf_checkpoint: set '
            "model.hf_checkpoint to the Hugging Face folder",
        )
        check(
            self.hf_config_mismatch in ("error", "warn"),
            f"model.hf_config_mismatch must be error or warn, got {self.hf_config_mismatch!r}",
        )


@dataclass
class Engram:
    enabled: bool = True
    """Attach Engram blocks at layer_ids. false: the plain backbone."""
    layer_ids: list[int] = field(default_factory=lambda: [1])
    """0-based decoder layer indices that get an Engram block (before attention)."""
    max_ngram: int = 3
    """Largest n-gram order; orders 2..max_ngram are hashed."""
    n_head_per_ngram: int = 8
    """Hash heads (tables) per n-gram order."""
    vocab_size_per_ngram: list[int] = field(default_factory=lambda: [646400, 646400])
    """Start of the prime search for each order's head tables (one entry per order 2..max_ngram)."""
    n_embed_per_ngram: int = 512
    """Embedding width per order; each head is n_embed_per_ngram / n_head_per_ngram wide."""
    kernel_size: int = 4
    """ShortConv kernel size (dilation = max_ngram)."""
    hc_mult: int = 1
    """Hyper-connection branches of the backbone; 1 for plain dense models."""
    seed: int = 0
    """Hash seed: multipliers come from default_rng(seed + 10007 * layer_id)."""
    pad_id: int = -1
    """Original token id used to left-pad n-grams. -1: the tokenizer's pad/eos id."""
    compress_tokenizer: bool = True
    """Map token ids through the normalised-text compression table before hashing."""
    respect_doc_boundaries: bool = False
    """Do not let n-grams reach across document boundaries of packed sequences."""
    use_bias: bool = False
    """Biases on the key/value projections (the official demo has them; the paper does not)."""
    init: str = "identity"
    """identity: zero value projection (ShortConv small normal), so the block outputs exactly 0 and a
    pretrained backbone is unchanged at step 0 (fine-tuning). paper: normal init everywhere
    (pre-training)."""
    table_init_std: float = 0.02
    """Std of the normal init of the embedding tables."""
    table_location: str = "device"
    """Where each rank's row shard of the tables and its optimizer state live: device (accelerator
    memory) | host (host memory: the rows a lookup touches are gathered on the host and copied to
    the device, the row-sparse optimizer updates the shard on the host; needs
    optimizer.table_optimizer = lazy_adam or rowwise_adagrad). Bitwise equal to device on CPU;
    see docs/host_tables.md."""
    host_memory_gib: float = 0.0
    """With table_location = host: host memory per node the table shards, their optimizer state
    and staging may use (GiB). 0: the node's MemAvailable (/proc/meminfo) at start. A run whose
    host tables need more fails at start, before allocating them."""

    def __post_init__(self) -> None:
        check(
            self.max_ngram >= 2,
            f"engram.max_ngram must be >= 2 (n-gram orders start at 2), got {self.max_ngram}",
        )
        check(
            len(self.vocab_size_per_ngram) == self.max_ngram - 1,
            f"engram.vocab_size_per_ngram needs one entry per order 2..{self.max_ngram} "
            f"({self.max_ngram - 1} entries), got {len(self.vocab_size_per_ngram)}",
        )
        check(
            all(v > 0 for v in self.vocab_size_per_ngram),
            "engram.vocab_size_per_ngram entries must be > 0",
        )
        for name in ("n_head_per_ngram", "n_embed_per_ngram", "kernel_size", "hc_mult"):
            check(getattr(self, name) > 0, f"engram.{name} must be > 0, got {getattr(self, name)}")
        check(
            self.n_embed_per_ngram % self.n_head_per_ngram == 0,
            f"engram.n_embed_per_ngram ({self.n_embed_per_ngram}) must be divisible by "
            f"engram.n_head_per_ngram ({self.n_head_per_ngram})",
        )
        check(
            len(set(self.layer_ids)) == len(self.layer_ids),
            f"engram.layer_ids has duplicates: {self.layer_ids}",
        )
        check(
            all(i >= 0 for i in self.layer_ids),
            f"engram.layer_ids must be >= 0, got {self.layer_ids}",
        )
        check(
            self.init in ("identity", "paper"),
            f"engram.init must be identity or paper, got {self.init!r}",
        )
        check(self.pad_id >= -1, "engram.pad_id must be a token id or -1 (tokenizer's pad/eos)")
        check(
            self.max_ngram <= MAX_NGRAM,
            f"engram.max_ngram = {self.max_ngram}, but the hashing kernels support n-gram orders "
            f"up to {MAX_NGRAM}",
        )
        _check_finite(self.table_init_std, "engram.table_init_std")
        check(self.table_init_std > 0, "engram.table_init_std must be > 0")
        _check_finite(self.host_memory_gib, "engram.host_memory_gib")
        check(self.host_memory_gib >= 0, "engram.host_memory_gib must be >= 0 (0: MemAvailable)")
        check(
            self.table_location in TABLE_LOCATIONS,
            f"engram.table_location must be one of {', '.join(TABLE_LOCATIONS)}, "
            f"got {self.table_location!r}",
        )

    @property
    def head_dim(self) -> int:
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def num_heads(self) -> int:
        """Hash heads per Engram layer (all orders)."""
        return (self.max_ngram - 1) * self.n_head_per_ngram


TRAINING_MODES = ("full", "engram_only", "lora")


@dataclass
class Training:
    mode: str = "full"
    """full: train everything. engram_only: freeze the backbone, train Engram blocks. lora: freeze
    the backbone, train LoRA adapters on lora.target_modules and every Engram parameter."""
    seq_len: int = 128
    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-batch."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step."""
    steps: int = 100
    """Optimizer steps to run."""
    max_norm: float = 1.0
    """Global gradient-norm clipping threshold; <= 0 disables clipping."""
    max_nonfinite_steps: int = 3
    """A step with a non-finite loss or gradient norm is skipped (no optimizer update); this
    many in a row stop the run with an error naming the last good checkpoint."""
    loss_chunks: int = 1
    """Chunked output head + cross-entropy (engram/train/loss.py): the loss applies the output head to
    at most this many sequence chunks of ceil(seq_len / loss_chunks) positions, one at a time,
    so only one chunk's fp32 logits exist (long sequences, large vocabularies). 1: the whole
    sequence at once. Same loss and gradients either way."""

    def __post_init__(self) -> None:
        check(
            self.mode in TRAINING_MODES,
            f"training.mode must be one of {', '.join(TRAINING_MODES)}, got {self.mode!r}",
        )
        for name in ("seq_len", "local_batch_size", "grad_accum_steps", "steps"):
            check(
                getattr(self, name) > 0, f"training.{name} must be > 0, got {getattr(self, name)}"
            )
        check(self.max_nonfinite_steps > 0, "training.max_nonfinite_steps must be > 0")
        check(
            1 <= self.loss_chunks <= self.seq_len,
            f"training.loss_chunks must be between 1 (no chunking) and training.seq_len="
            f"{self.seq_len}, got {self.loss_chunks}",
        )
        _check_finite(self.max_norm, "training.max_norm", "(use 0 to disable clipping)")


@dataclass
class DataSource:
    """One pre-tokenized dataset of a mixture (an entry of data.sources)."""

    path: str = ""
    """Folder written by scripts/prepare_data.py."""
    weight: float = 1.0
    """Relative share of the training samples drawn from this source (normalised over sources)."""

    def __post_init__(self) -> None:
        check(bool(self.path), "data.sources entries need a path (a prepared token folder)")
        _check_finite(self.weight, f"data.sources weight (source {self.path!r})")
        check(self.weight > 0, f"data.sources weight must be > 0, got {self.weight}")


@dataclass
class Data:
    dataset: str = "synthetic_facts"
    """synthetic_facts (generated, deterministic) | text (a .txt file or folder) | jsonl ("text" field) | tokens (folders written by scripts/prepare_data.py: memory-mapped, for large corpora)."""
    path: str = ""
    """File or folder for text/jsonl datasets; the prepared folder for tokens (or use sources)."""
    num_workers: int = 0
    """Data-loader worker processes (hash ids are computed there)."""
    synthetic_num_entities: int = 512
    """Entities in the synthetic fact base."""
    synthetic_seed: int = 1234
    """Seed of the synthetic fact base."""
    eval_every: int = 0
    """Evaluate held-out loss every N steps (0: only at the end when eval_batches > 0)."""
    eval_batches: int = 0
    """Held-out batches per evaluation (0: no evaluation)."""
    sources: list[DataSource] = field(default_factory=list)
    """tokens only: a weighted mixture of prepared folders, as a TOML array of tables
    [[data.sources]] path = "..." weight = 0.7 (instead of data.path)."""

    def __post_init__(self) -> None:
        check(
            self.dataset in ("synthetic_facts", "text", "jsonl", "tokens"),
            f"data.dataset must be synthetic_facts, text, jsonl or tokens, got {self.dataset!r}",
        )
        check(
            self.dataset == "tokens" or not self.sources,
            'data.sources (a mixture) needs data.dataset = "tokens": prepare each corpus with '
            "scripts/prepare_data.py",
        )
        check(
            not (self.path and self.sources),
            "set data.path (one prepared folder) or data.sources (a mixture), not both",
        )
        check(
            self.dataset == "synthetic_facts" or bool(self.path) or bool(self.sources),
            f"data.path is required for data.dataset={self.dataset!r}",
        )
        for name in ("num_workers", "eval_every", "eval_batches"):
            check(getattr(self, name) >= 0, f"data.{name} must be >= 0")
        check(self.synthetic_num_entities > 0, "data.synthetic_num_entities must be > 0")

    @property
    def token_sources(self) -> list[DataSource]:
        """The mixture of a tokens dataset: data.sources, or data.path with weight 1."""
        return list(self.sources) if self.sources else [DataSource(self.path, 1.0)]


# Work O(rows touched) per step: the only ones host-resident tables accept.
ROW_SPARSE_TABLE_OPTIMIZERS = tuple(n for n, s in TABLE_OPTIMIZERS.items() if s.row_sparse)


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer for backbone and Engram dense parts (AdamW)."""
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    engram_lr_mult: float = 1.0
    """Learning-rate multiplier for Engram dense parts (projections, norms, conv)."""
    table_lr_mult: float = 5.0
    """Learning-rate multiplier for the Engram embedding tables (paper: 5)."""
    table_weight_decay: float = 0.0
    """Weight decay of the Engram tables (paper: 0)."""
    table_lazy: bool = False
    """Deprecated alias of table_optimizer = "lazy_adam" (read, then normalised to false)."""
    table_optimizer: str = "adam"
    """Optimizer of the Engram tables: adam (dense Adam, every row's moments decay every step,
    dense table gradient) | lazy_adam (torch SparseAdam's update on the rows touched this step;
    row-sparse gradients, O(touched rows) per step) | rowwise_adagrad (row-wise Adagrad: one fp32
    state value per row instead of two per parameter; row-sparse, O(touched rows)). See
    docs/architecture.md, "Engram table optimizers"."""

    def __post_init__(self) -> None:
        check(self.name == "AdamW", f"optimizer.name must be AdamW, got {self.name!r}")
        for name in ("lr", "eps", "weight_decay", "engram_lr_mult", "table_lr_mult"):
            _check_finite(getattr(self, name), f"optimizer.{name}")
        _check_finite(self.table_weight_decay, "optimizer.table_weight_decay")
        for i, b in enumerate(self.betas):
            _check_finite(b, f"optimizer.betas[{i}]")
        check(
            self.table_optimizer in TABLE_OPTIMIZERS,
            f"optimizer.table_optimizer must be one of {', '.join(TABLE_OPTIMIZERS)}, "
            f"got {self.table_optimizer!r}",
        )
        if self.table_lazy:
            check(
                self.table_optimizer in ("adam", "lazy_adam"),
                f"optimizer.table_lazy = true contradicts table_optimizer = "
                f"{self.table_optimizer!r}: drop table_lazy (deprecated)",
            )
            warnings.warn(
                'optimizer.table_lazy is deprecated: use optimizer.table_optimizer = "lazy_adam"',
                DeprecationWarning,
                stacklevel=2,
            )
            self.table_optimizer, self.table_lazy = "lazy_adam", False
        check(self.lr > 0, "optimizer.lr must be > 0")
        check(self.eps >= 0, "optimizer.eps must be >= 0")
        for name in ("weight_decay", "table_weight_decay"):
            check(getattr(self, name) >= 0, f"optimizer.{name} must be >= 0")
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optimizer.betas must be two values in [0, 1)",
        )
        check(
            self.table_lr_mult > 0 and self.engram_lr_mult > 0,
            "optimizer.table_lr_mult and optimizer.engram_lr_mult must be > 0",
        )


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    """Linear warmup: step s <= W = warmup_steps runs at peak x s / (W + 1)."""
    decay_type: str = "cosine"
    """cosine | linear | constant after warmup. Step s > W (of T = training.steps) runs at
    peak x (r + (1 - r) g(p)), r = min_lr_ratio, p = (s - W - 1) / (T - W - 1), g(p) =
    (1 + cos(pi p)) / 2 (cosine), 1 - p (linear), 1 (constant): step W + 1 at the peak, step T
    at r x peak (engram/optim/builder.py lr_lambda)."""
    min_lr_ratio: float = 0.1
    """lr of the last step as a fraction of the peak lr (cosine / linear)."""

    def __post_init__(self) -> None:
        check(self.warmup_steps >= 0, "lr_scheduler.warmup_steps must be >= 0")
        check(
            self.decay_type in ("cosine", "linear", "constant"),
            "lr_scheduler.decay_type must be cosine, linear or constant",
        )
        check(0 <= self.min_lr_ratio <= 1, "lr_scheduler.min_lr_ratio must be in [0, 1]")


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
    fsdp_reshard_after_forward: str = "default"
    """always (ZeRO-3-like) | never (ZeRO-2-like) | default (always, except the root)."""
    engram_table_dedup: bool = True
    """De-duplicate hash ids before the all-to-all of the sharded table lookup."""
    engram_a2a_dtype: str = ""
    """Dtype of the table rows and row gradients in the lookup's all-to-all: "" (the table's
    dtype), float32 or bfloat16 (half the bytes; the table and its optimizer stay fp32)."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer state (ZeRO-Offload)."""
    mixed_precision_param: str = "float32"
    """FSDP2 compute dtype of parameters: float32 | bfloat16."""
    mixed_precision_reduce: str = "float32"
    """FSDP2 gradient reduction dtype: float32 | bfloat16."""
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


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"
    """Sub-folder of the run folder that holds step-N checkpoints."""
    interval: int = 500
    """Save every N steps (and at the last step)."""
    keep_latest_k: int = 3
    """Keep the newest k checkpoints; 0 keeps all."""
    load_step: int = -1
    """Resume from this step; -1: the newest checkpoint (an error if it is damaged, see
    on_damaged); 0: start from step 0 even if the folder holds checkpoints (they are kept)."""
    on_damaged: str = "error"
    """When the checkpoint to resume from fails its manifest check: error (stop, change nothing)
    | previous (resume from the newest intact older checkpoint, with a loud warning)."""
    async_mode: str = "disabled"
    """disabled: a save blocks training until it is on disk. async: the state is copied to CPU
    memory (staging: one extra copy of this rank's model + optimizer state in host memory), DCP
    writes it in a background thread, and the checkpoint is verified and committed at the next
    save (which waits for it); the last step's save is synchronous."""
    trainable_only: bool = False
    """Save only the trainable parameters (LoRA adapters, Engram) and their optimizer state, not
    the frozen backbone (training.mode lora / engram_only): a resume rebuilds the backbone from
    model.hf_checkpoint (the same folder) or, without one, from job.seed."""

    def __post_init__(self) -> None:
        check(self.interval >= 1, "checkpoint.interval must be >= 1")
        check(self.keep_latest_k >= 0, "checkpoint.keep_latest_k must be >= 0")
        check(self.load_step >= -1, "checkpoint.load_step must be >= -1")
        check(
            self.async_mode in ("disabled", "async"),
            f"checkpoint.async_mode must be disabled or async, got {self.async_mode!r}",
        )
        check(
            self.on_damaged in ("error", "previous"),
            f"checkpoint.on_damaged must be error or previous, got {self.on_damaged!r}",
        )


@dataclass
class Metrics:
    log_freq: int = 1
    """Log to console / TensorBoard / metrics.jsonl every N steps."""
    enable_tensorboard: bool = True
    tb_folder: str = "tb"
    """Sub-folder of the run folder for TensorBoard events."""

    def __post_init__(self) -> None:
        check(self.log_freq >= 1, "metrics.log_freq must be >= 1")


@dataclass
class Profiling:
    enable_profiling: bool = False
    """torch.profiler traces (TensorBoard-viewable) every profile_freq steps."""
    profile_freq: int = 10
    traces_folder: str = "profile_traces"
    memory_snapshot: bool = False
    """cuda / npu: record allocator history; on out-of-memory write <run folder>/memory_snapshot/rank<k>_oom.pickle (drop it on https://pytorch.org/memory_viz). Ignored (with a warning) on cpu."""

    def __post_init__(self) -> None:
        check(self.profile_freq >= 1, "profiling.profile_freq must be >= 1")


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

    def __post_init__(self) -> None:
        check(bool(self.backend), "compile.backend must not be empty (e.g. inductor)")


# HF projection names (what PEFT's target_modules use) -> this repo's module names.
LORA_TARGETS = {
    "q_proj": "attention.wq",
    "k_proj": "attention.wk",
    "v_proj": "attention.wv",
    "o_proj": "attention.wo",
    "gate_proj": "feed_forward.w1",
    "up_proj": "feed_forward.w3",
    "down_proj": "feed_forward.w2",
}


@dataclass
class Lora:
    """LoRA adapters (training.mode = "lora"): y = W x + (alpha / rank) B A dropout(x), A [rank,
    in] normal(0, 1 / in), B [out, rank] zero, so the model is unchanged at step 0."""

    rank: int = 8
    """Adapter rank r (PEFT's `r`)."""
    alpha: float = 16.0
    """Scaling numerator: the adapter output is multiplied by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1) (PEFT's lora_dropout)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Projections that get adapters, by their Hugging Face names: q_proj k_proj v_proj o_proj
    (attention), gate_proj up_proj down_proj (MLP). Default: all of them."""
    frozen_dtype: str = "compute"
    """dtype the frozen backbone is held in: compute (parallelism.mixed_precision_param where FSDP
    applies, e.g. bfloat16 on accelerators: half the bytes, no fp32 master copy, no gradient, no
    optimizer state) | float32."""

    def __post_init__(self) -> None:
        check(self.rank >= 1, f"lora.rank must be >= 1, got {self.rank}")
        _check_finite(self.alpha, "lora.alpha")
        check(self.alpha > 0, f"lora.alpha must be > 0, got {self.alpha}")
        _check_finite(self.dropout, "lora.dropout")
        check(0 <= self.dropout < 1, f"lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        check(
            not unknown,
            f"lora.target_modules {unknown} match no module; valid names: "
            f"{', '.join(LORA_TARGETS)}",
        )
        check(bool(self.target_modules), "lora.target_modules must name at least one projection")
        check(
            self.frozen_dtype in ("compute", "float32"),
            f"lora.frozen_dtype must be compute or float32, got {self.frozen_dtype!r}",
        )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


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
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    engram: Engram = field(default_factory=Engram)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    pipeline: Pipeline = field(default_factory=Pipeline)
    float8: Float8 = field(default_factory=Float8)
    compile: Compile = field(default_factory=Compile)
    deepspeed: DeepSpeed = field(default_factory=DeepSpeed)
    lora: Lora = field(default_factory=Lora)

    def __post_init__(self) -> None:
        check(
            not (
                self.engram.enabled
                and self.engram.table_location == "host"
                and self.optimizer.table_optimizer not in ROW_SPARSE_TABLE_OPTIMIZERS
            ),
            f"engram.table_location = host needs a row-sparse table optimizer, got "
            f"optimizer.table_optimizer = {self.optimizer.table_optimizer!r} (dense Adam touches "
            f"every row every step): set optimizer.table_optimizer to "
            f"{' or '.join(ROW_SPARSE_TABLE_OPTIMIZERS)}",
        )

    @property
    def run_folder(self) -> Path:
        return Path(self.job.dump_folder) / self.job.run_name

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)
