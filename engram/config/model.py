"""Config sections that say what model is built: `[model]` (backbone shape, HF folder), `[engram]`
(layers, tables, hashing) and `[lora]` (adapters)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engram.config.checks import check, check_finite
from engram.config.table_locations import TABLE_LOCATIONS

# model.attn_mask_type / attn_backend (also checked by ModelArgs).
ATTN_MASK_TYPES = ("causal", "block_causal")
ATTN_BACKENDS = ("sdpa", "flex")

# Largest n-gram order of the C hashing kernel (MAX_NGRAM in engram/hashing/csrc/ngram_hash.c).
MAX_NGRAM = 16


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
    attn_mask_type: str = "causal"
    """causal | block_causal. causal: every token attends to all earlier tokens of its sequence,
    across the documents packed into it (plain-text pretraining, as before). block_causal: a
    token attends only to earlier tokens of its own document (the batch's segment_ids: a
    document ends with its eos; chat / SFT packing), the Engram ShortConv stops at document
    starts, and RoPE positions restart at 0 in each document (as TRL's padding-free packing;
    RoPE is relative, so within a document this equals global positions up to rounding);
    packed documents then train as if each were its own sequence. Needs engram.respect_doc_boundaries = true (n-grams stop at
    the same boundaries). Generation (one document) is unaffected. Memory with attn_backend =
    "sdpa": a bool [B, T, T] mask per micro-batch, which SDPA turns into a compute-dtype mask
    saved per layer (docs/architecture.md, "Packed documents")."""
    attn_backend: str = "sdpa"
    """sdpa | flex: the kernel of the block_causal mask. sdpa: portable (CPU, CUDA, NPU), with
    the [B, T, T] mask above. flex: torch FlexAttention with a block mask built from the segment
    ids (no T x T tensor): CUDA (compiled), and on CPU forward only (no backward: train on CPU
    with sdpa); not on NPU. Plain causal attention always runs SDPA's fused causal kernel."""

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
        for name, valid in (
            ("attn_mask_type", ATTN_MASK_TYPES),
            ("attn_backend", ATTN_BACKENDS),
        ):
            check(
                getattr(self, name) in valid,
                f"model.{name} must be one of {', '.join(valid)}, got {getattr(self, name)!r}",
            )
        check(
            self.attn_backend == "sdpa" or self.attn_mask_type == "block_causal",
            f"model.attn_backend = {self.attn_backend!r} is for attn_mask_type = 'block_causal' "
            "(plain causal attention runs SDPA's fused causal kernel): set attn_backend = 'sdpa'",
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
    optimizer.table_optimizer = lazy_adam or rowwise_adagrad) | nvme (page files under
    engram.nvme_dirs with a host cache of engram.nvme_host_cache_gib; same optimizers). Bitwise
    equal to device on CPU; see docs/host_tables.md."""
    host_memory_gib: float = 0.0
    """Host memory per node the run's host-side state may use (GiB): host table shards, their
    optimizer state and staging, NVMe host caches, and an asynchronous checkpoint's staging
    copy (checkpoint.async_mode = "async"). 0: the node's MemAvailable (/proc/meminfo) at start.
    A run that needs more fails at start, before allocating it (runner/start_checks.py)."""
    nvme_dirs: list[str] = field(default_factory=list)
    """With table_location = nvme: directories on local disks (one per drive) for the table
    shards' page files; each shard's pages stripe over them. Scratch space, not the checkpoint:
    the files are deleted when the run ends."""
    nvme_host_cache_gib: float = 1.0
    """With table_location = nvme: host memory per rank for the cache of table pages (GiB),
    split over the rank's tables. A step's rows are pinned in it from prefetch to their update,
    so they must fit; the run fails naming this setting otherwise."""
    nvme_probe_s: float = 1.0
    """With table_location = nvme: seconds of random 4 KiB reads of the page files at start
    (after init), set against the page reads a step needs; a drive too slow for them is warned
    about, naming both numbers (runner/start_checks.py). 0: no probe."""
    nvme_create_dirs: bool = False
    """With table_location = nvme: create an engram.nvme_dirs entry that does not exist yet
    (its parent must: a drive's mount point). false: a missing entry is refused at start, so a
    mistyped or unmounted path never fills whatever disk holds it."""

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
        check_finite(self.table_init_std, "engram.table_init_std")
        check(self.table_init_std > 0, "engram.table_init_std must be > 0")
        check_finite(self.host_memory_gib, "engram.host_memory_gib")
        check(self.host_memory_gib >= 0, "engram.host_memory_gib must be >= 0 (0: MemAvailable)")
        check_finite(self.nvme_host_cache_gib, "engram.nvme_host_cache_gib")
        check(self.nvme_host_cache_gib > 0, "engram.nvme_host_cache_gib must be > 0")
        check_finite(self.nvme_probe_s, "engram.nvme_probe_s")
        check(self.nvme_probe_s >= 0, "engram.nvme_probe_s must be >= 0 (0: no probe)")
        check(
            self.table_location != "nvme" or bool(self.nvme_dirs),
            'engram.table_location = "nvme" needs engram.nvme_dirs: directories on local disks '
            'for the table page files, e.g. nvme_dirs = ["/mnt/nvme0/engram"]',
        )
        if self.table_location != "nvme":
            nvme_only = {  # setting -> its default: read only with table_location = "nvme"
                "nvme_dirs": [], "nvme_host_cache_gib": 1.0, "nvme_create_dirs": False
            }  # fmt: skip
            for name, default in nvme_only.items():
                check(
                    getattr(self, name) == default,
                    f"engram.{name} is set ({getattr(self, name)!r}) but engram.table_location "
                    f'= "{self.table_location}": it is read only with table_location = "nvme"; '
                    f'set table_location = "nvme" or remove engram.{name}',
                )
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
    in] drawn by init_a, B [out, rank] zero, so the model is unchanged at step 0."""

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
    """dtype the frozen backbone is held in: compute (parallelism.mixed_precision_param, at every
    layout, e.g. bfloat16 on accelerators: half the bytes, no fp32 master copy, no gradient, no
    optimizer state) | float32."""
    init_a: str = "normal"
    """Init of A: normal (N(0, 1 / in), this repo's default) | peft (U(-1/sqrt(in), 1/sqrt(in)),
    PEFT's default: kaiming_uniform with a = sqrt(5), nn.Linear's init). Step 0 only."""

    def __post_init__(self) -> None:
        check(self.rank >= 1, f"lora.rank must be >= 1, got {self.rank}")
        check_finite(self.alpha, "lora.alpha")
        check(self.alpha > 0, f"lora.alpha must be > 0, got {self.alpha}")
        check_finite(self.dropout, "lora.dropout")
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
        check(
            self.init_a in ("normal", "peft"),
            f"lora.init_a must be normal or peft, got {self.init_a!r}",
        )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def module_paths(self) -> list[str]:
        """This repo's module paths (inside a decoder layer) of `target_modules`: the one
        mapping every reader uses (the adapters, the inference build, the FLOP count)."""
        return [LORA_TARGETS[t] for t in self.target_modules]
