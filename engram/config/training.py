"""Config sections that say how a run trains and what it records: `[job]`, `[training]`, `[data]`,
`[optimizer]`, `[lr_scheduler]`, `[checkpoint]`, `[metrics]`, `[profiling]`."""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path

from engram.config.checks import ConfigError, check, check_finite
from engram.config.table_optimizers import TABLE_OPTIMIZERS


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
    cpu_affinity: str = "numa"
    """numa: pin each rank (and so its host-table worker thread and data-loader workers) to the
    CPUs of its device's NUMA node where sysfs tells it (CUDA; NPUs and the CPU are "unknown",
    not pinned) | none: leave placement to the OS. engram/runtime/affinity.py."""

    def __post_init__(self) -> None:
        check(
            self.device in ("auto", "cpu", "cuda", "npu"),
            f"job.device must be auto, cpu, cuda or npu, got {self.device!r}",
        )
        check(
            self.cpu_affinity in ("numa", "none"),
            f"job.cpu_affinity must be numa or none, got {self.cpu_affinity!r}",
        )
        check(bool(self.run_name), "job.run_name must not be empty")
        check(
            not Path(self.run_name).is_absolute() and ".." not in Path(self.run_name).parts,
            f"job.run_name = {self.run_name!r} must stay inside job.dump_folder: a relative "
            "name without '..' (e.g. 'exp1' or 'sweeps/exp1'); move the output root with "
            "job.dump_folder",
        )


TRAINING_MODES = ("full", "engram_only", "lora")


@dataclass
class Training:
    mode: str = "full"
    """full: train everything. engram_only: freeze the backbone, train Engram blocks. lora: freeze
    the backbone, train LoRA adapters on lora.target_modules and every Engram parameter."""
    seq_len: int = 128
    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-batch (what a rank holds at once: its memory)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step. Derived when global_batch_size is set (leave it at 1
    then, or give the derived value)."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all data-parallel ranks (torchtitan's setting). 0: not
    set, the global batch is local_batch_size x grad_accum_steps x dp, so it grows with the
    number of ranks. > 0: the same global batch at every world size: at start the run derives
    grad_accum_steps = global_batch_size / (local_batch_size x dp), which must come out whole
    (else it stops, naming the fix); local_batch_size stays as given (global_batch_size and
    local_batch_size win over grad_accum_steps)."""
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
        g, b = self.global_batch_size, self.local_batch_size
        check(g >= 0, f"training.global_batch_size must be >= 0 (0: not set), got {g}")
        check(
            g % b == 0,
            f"training.global_batch_size={g} is not a multiple of training.local_batch_size={b}: "
            "no number of ranks and accumulation steps gives it; choose a local_batch_size that "
            "divides it",
        )
        check(self.max_nonfinite_steps > 0, "training.max_nonfinite_steps must be > 0")
        check(
            1 <= self.loss_chunks <= self.seq_len,
            f"training.loss_chunks must be between 1 (no chunking) and training.seq_len="
            f"{self.seq_len}, got {self.loss_chunks}",
        )
        check_finite(self.max_norm, "training.max_norm", "(use 0 to disable clipping)")

    def at_dp(self, dp: int) -> Training:
        """This section at `dp` data-parallel ranks: with global_batch_size set, grad_accum_steps
        derived from it (local_batch_size x grad_accum_steps x dp = global_batch_size), or a
        ConfigError naming the fix; unchanged without it."""
        g, b, a = self.global_batch_size, self.local_batch_size, self.grad_accum_steps
        if not g:
            return self
        per_micro = b * dp
        if g % per_micro:
            fits = [n for n in range(1, g // dp + 1) if g % (n * dp) == 0] if g % dp == 0 else []
            fix = (
                f"a training.local_batch_size in {fits}"
                if fits
                else f"a number of data-parallel ranks that divides {g}"
            )
            raise ConfigError(
                f"training.global_batch_size={g} does not split into training.local_batch_size="
                f"{b} x {dp} data-parallel ranks x whole accumulation steps ({g} is not a "
                f"multiple of {per_micro}): use {fix}, or a global_batch_size that is a multiple "
                f"of {per_micro}"
            )
        derived = g // per_micro
        check(
            a in (1, derived),
            f"training.grad_accum_steps={a} contradicts training.global_batch_size={g}, which "
            f"at local_batch_size={b} and {dp} data-parallel ranks gives grad_accum_steps = "
            f"{derived}: leave grad_accum_steps out (it is derived), or set global_batch_size = 0",
        )
        return dataclasses.replace(self, grad_accum_steps=derived)


@dataclass
class DataSource:
    """One pre-tokenized dataset of a mixture (an entry of data.sources)."""

    path: str = ""
    """Folder written by scripts/prepare_data.py."""
    weight: float = 1.0
    """Relative share of the training samples drawn from this source (normalised over sources)."""

    def __post_init__(self) -> None:
        check(bool(self.path), "data.sources entries need a path (a prepared token folder)")
        check_finite(self.weight, f"data.sources weight (source {self.path!r})")
        check(self.weight > 0, f"data.sources weight must be > 0, got {self.weight}")


DATASETS = ("synthetic_facts", "text", "jsonl", "tokens", "chat", "synthetic_chat")
CHAT_DATASETS = ("chat", "synthetic_chat")
SYNTHETIC_PARTS = ("all", "pretrain", "finetune")


@dataclass
class Data:
    dataset: str = "synthetic_facts"
    """synthetic_facts (generated, deterministic) | text (a .txt file or folder) | jsonl ("text" field) | tokens (folders written by scripts/prepare_data.py: memory-mapped, for large corpora) | chat (fine-tuning records: .jsonl / .parquet files or folders of `messages`, `prompt` + `completion` or `text` records, or a folder written by scripts/prepare_data.py --chat; docs/data.md "Fine-tuning data") | synthetic_chat (question / answer conversations about the synthetic facts, generated)."""
    path: str = ""
    """File or folder for text/jsonl/chat datasets; the prepared folder for tokens (or use sources)."""
    num_workers: int = 0
    """Data-loader worker processes (hash ids are computed there)."""
    synthetic_num_entities: int = 512
    """Entities in the synthetic fact base."""
    synthetic_seed: int = 1234
    """Seed of the synthetic fact base."""
    synthetic_part: str = "all"
    """synthetic_facts / synthetic_chat: which entities of the fact base the data is about: all |
    pretrain (a seeded synthetic_pretrain_fraction of them) | finetune (the others), so a model
    pretrained on one part can be fine-tuned on questions about facts it never saw."""
    synthetic_pretrain_fraction: float = 0.5
    """Share of the entities in the pretrain part (synthetic_part); the rest are the finetune part."""
    train_on: str = "assistant"
    """chat datasets: which tokens are targets (the others get label -100): assistant (the
    assistant turns' content and end-of-turn token, located by rendering the chat template; the
    completion of prompt / completion records; all of a text record) | all (every token)."""
    pack: bool = True
    """chat datasets: true: pack several conversations per sequence (segment_ids mark them;
    attention and Engram n-grams stay inside a conversation); false: one conversation per
    sequence, padded (pad label -100)."""
    overflow: str = "truncate"
    """chat datasets: a conversation longer than training.seq_len + 1 tokens is truncate(d: its
    first seq_len + 1 tokens) | drop(ped) | error (stop at start, naming it). Truncated and dropped
    ones are counted and logged at start."""
    chat_template: str = ""
    """chat datasets: the chat template to render conversations with: a .jinja file or a
    tokenizer_config.json holding chat_template. Empty: the tokenizer's own (chat_template.jinja
    or tokenizer_config.json next to its tokenizer.json)."""
    chat_template_kwargs: str = ""
    """chat datasets: a JSON object of extra template variables for every conversation, e.g.
    '{"date_string": "26 Jul 2024"}' (Llama 3 templates otherwise print today's date, so the data
    would change from day to day) or '{"enable_thinking": false}'. A record's own
    chat_template_kwargs override it."""
    eval_every: int = 0
    """Evaluate held-out loss every N steps (0: only at the end when eval_batches > 0)."""
    eval_batches: int = 0
    """Held-out batches per evaluation (0: no evaluation): loader batches of
    training.local_batch_size x dp sequences, or, with training.global_batch_size set, batches
    of that many sequences (grad_accum_steps loader batches each), so that the held-out set is
    the same at every number of ranks."""
    eval_exact_match: int = 0
    """chat datasets: held-out questions answered greedily through the chat template at every
    evaluation (every eval_every steps and at the last), scored by exact match against the
    reference answers and logged as eval_exact_match (engram/inference/qa.py says what is asked
    and how answers are normalised). 0: none. The first N of the held-out split (synthetic_chat:
    its held-out phrasings)."""
    eval_max_new_tokens: int = 32
    """Most tokens of one answer in the exact-match evaluation (it stops earlier at eos or the
    chat template's end-of-turn token)."""
    sources: list[DataSource] = field(default_factory=list)
    """tokens only: a weighted mixture of prepared folders, as a TOML array of tables
    [[data.sources]] path = "..." weight = 0.7 (instead of data.path)."""

    def __post_init__(self) -> None:
        check(
            self.dataset in DATASETS,
            f"data.dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}",
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
            self.dataset in ("synthetic_facts", "synthetic_chat")
            or bool(self.path)
            or bool(self.sources),
            f"data.path is required for data.dataset={self.dataset!r}",
        )
        check(
            not (self.dataset == "synthetic_chat" and self.path),
            "data.dataset = synthetic_chat is generated and reads no files: remove data.path, or "
            'use data.dataset = "chat" for a chat set on disk',
        )
        for name in ("num_workers", "eval_every", "eval_batches", "eval_exact_match"):
            check(getattr(self, name) >= 0, f"data.{name} must be >= 0")
        check(self.eval_max_new_tokens >= 1, "data.eval_max_new_tokens must be >= 1")
        check(
            not self.eval_exact_match or self.dataset in CHAT_DATASETS,
            f"data.eval_exact_match asks questions of a chat set, but data.dataset = "
            f"{self.dataset!r} is plain text: use chat or synthetic_chat, or remove it",
        )
        check(self.synthetic_num_entities > 0, "data.synthetic_num_entities must be > 0")
        check(
            self.synthetic_part in SYNTHETIC_PARTS,
            f"data.synthetic_part must be one of {', '.join(SYNTHETIC_PARTS)}, "
            f"got {self.synthetic_part!r}",
        )
        check_finite(self.synthetic_pretrain_fraction, "data.synthetic_pretrain_fraction")
        check(
            0.0 < self.synthetic_pretrain_fraction < 1.0,
            "data.synthetic_pretrain_fraction must be strictly between 0 and 1 (both parts need "
            f"entities), got {self.synthetic_pretrain_fraction}",
        )
        check(
            self.synthetic_part == "all" or self.dataset in ("synthetic_facts", "synthetic_chat"),
            f"data.synthetic_part = {self.synthetic_part!r} selects synthetic entities, but "
            f"data.dataset = {self.dataset!r} is not synthetic: remove it",
        )
        check(
            self.train_on in ("assistant", "all"),
            f"data.train_on must be assistant or all, got {self.train_on!r}",
        )
        check(
            self.overflow in ("truncate", "drop", "error"),
            f"data.overflow must be truncate, drop or error, got {self.overflow!r}",
        )
        self.chat_kwargs()  # a JSON object, or refused here
        if self.dataset not in CHAT_DATASETS:
            defaults = {f.name: f.default for f in fields(self)}
            changed = [
                name
                for name in (
                    "train_on",
                    "pack",
                    "overflow",
                    "chat_template",
                    "chat_template_kwargs",
                )
                if getattr(self, name) != defaults[name]
            ]
            check(
                not changed,
                f"data.{', data.'.join(changed)} set, but data.dataset = {self.dataset!r} is "
                "plain text (every token a target, packed): they apply to chat and synthetic_chat "
                "datasets only; remove them",
            )

    def chat_kwargs(self) -> dict:
        """chat_template_kwargs parsed (a dict; {} when empty)."""
        if not self.chat_template_kwargs:
            return {}
        try:
            value = json.loads(self.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"data.chat_template_kwargs is not JSON ({e.msg}): write a JSON object, e.g. "
                '\'{"date_string": "26 Jul 2024"}\''
            ) from None
        check(
            isinstance(value, dict),
            f"data.chat_template_kwargs must be a JSON object {{...}}, got {value!r}",
        )
        return value

    @property
    def token_sources(self) -> list[DataSource]:
        """The mixture of a tokens dataset: data.sources, or data.path with weight 1."""
        return list(self.sources) if self.sources else [DataSource(self.path, 1.0)]


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
            check_finite(getattr(self, name), f"optimizer.{name}")
        check_finite(self.table_weight_decay, "optimizer.table_weight_decay")
        for i, b in enumerate(self.betas):
            check_finite(b, f"optimizer.betas[{i}]")
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
    table_full_every: int = 1
    """Incremental Engram table checkpoints (a row-sparse table optimizer, any table_location;
    not the DeepSpeed variant): every k-th save writes every
    table row and its optimizer state (a base), the saves between write only the rows the
    optimizer updated since the previous save, with global row ids (a delta); a resume replays
    the base and the deltas (engram/checkpoint/table_delta.py). 1: every save is full."""

    def __post_init__(self) -> None:
        check(self.interval >= 1, "checkpoint.interval must be >= 1")
        check(self.table_full_every >= 1, "checkpoint.table_full_every must be >= 1")
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


EXPORT_LORA = ("peft", "merged")


@dataclass
class Export:
    folder: str = ""
    """When training ends, export the run's last checkpoint into this folder, as
    scripts/export_hf.py does (docs/export.md): a Hugging Face folder transformers loads (with
    Engram: trust_remote_code), or with training.mode = "lora" the folder `lora` says. Its model
    files are replaced (scripts/export_hf.py --overwrite); a run's own folder is refused. Empty:
    no export. Needs checkpoint.enable = true (the last step is always saved)."""
    lora: str = "peft"
    """training.mode = "lora": peft (a PEFT adapter folder + engram.safetensors, loaded on the
    transformers base model of model.hf_checkpoint) | merged (the Hugging Face folder of the whole
    model with the adapters folded into the base weights: scripts/export_hf.py --merged)."""

    def __post_init__(self) -> None:
        check(
            self.lora in EXPORT_LORA,
            f"export.lora must be one of {', '.join(EXPORT_LORA)}, got {self.lora!r}",
        )


@dataclass
class Metrics:
    log_freq: int = 1
    """Log to console / TensorBoard / metrics.jsonl every N steps."""
    enable_tensorboard: bool = True
    tb_folder: str = "tb"
    """Sub-folder of the run folder for TensorBoard events."""
    telemetry: bool = True
    """On log steps, per Engram layer: the gates' mean, share open and entropy, the branch's
    output RMS over the residual's, table rows touched and the update's RMS; with NVMe tables
    the page I/O of the window (docs/telemetry.md). Costs one all-reduce and one host read per
    log step. false: none of these keys."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s per device that `mfu` divides by. 0: the dense bf16 figure of engram/runtime/device_specs.py for the device's name, or on cpu (and devices the table lacks) a short GEMM measured at start (logged as "measured"; the key is then `mfu_indicative`, a figure that moves with the machine's load)."""

    def __post_init__(self) -> None:
        check(self.log_freq >= 1, "metrics.log_freq must be >= 1")
        check_finite(self.peak_tflops, "metrics.peak_tflops")
        check(self.peak_tflops >= 0, "metrics.peak_tflops must be >= 0 (0 = from the device table)")


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
