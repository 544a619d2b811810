"""What the planner models, by name: every step of parallelize_model and every config setting.

A feature that changes what a rank holds or runs registers here, with the planner code that
models it. The planner refuses (check_modelled, first thing estimate() does):

- a step of `parallelisms.parallelize.parallelize_model` it does not list: every `apply_*`
  function in that module's namespace is a step;
- a config setting it does not list, set to anything but its default, and a listed setting at a
  value it does not model (MODELLED_VALUES).

tests/test_planner.py checks that every setting of JobConfig is listed, so a new setting fails CI
until it is classified here.
"""

from __future__ import annotations

import dataclasses

from engram.config import ConfigError, JobConfig

STEPS = {  # parallelize_model step -> where its memory is modelled
    "apply_float8": "activations.float8_cast_bytes (weights stay high precision; transient casts)",
    "apply_tp": "measure (local DTensor shapes); activations and comm (axis_divisors)",
    "apply_context_parallel": "activations (tokens / cp, K / V per method, cached masks), comm (cp)",
    "apply_engram_table_sharding": "measure (table rows), tables (optimizer state), comm",
    "apply_activation_checkpointing": "activations (is_checkpointed)",
    "apply_compile": "estimated as eager (inductor saves activation memory, never adds much)",
    "apply_fsdp": "measure (shards), fsdp_buffers, comm",
    "apply_lora": "measure (adapters are built parameters; the frozen backbone at its held dtype)",
    "apply_training_mode": "measure (frozen parameters hold no gradient or optimizer state)",
}

MODELLED = {  # setting -> where the planner models it
    "job.device": "estimate (device memory default), float8 refusal on npu",
    **dict.fromkeys(
        ("model.name", "model.flavor", "model.vocab_size", "model.tokenizer_path"),
        "measure (the model is built on meta)",
    ),
    "model.hf_config_mismatch": "measure (flavor hf reads the checkpoint's config.json)",
    "model.attn_mask_type": "activations.document_mask_bytes (SDPA's [B, T, T] mask per layer), "
    "cp_mask_bytes, step_model (an explicit mask computes every score)",
    "model.attn_backend": "activations.document_mask_bytes (flex: a block mask, no T x T)",
    **dict.fromkeys(
        (
            "engram.enabled",
            "engram.layer_ids",
            "engram.max_ngram",
            "engram.n_head_per_ngram",
            "engram.vocab_size_per_ngram",
            "engram.n_embed_per_ngram",
            "engram.kernel_size",
            "engram.hc_mult",
            "engram.use_bias",
        ),
        "measure (built), activations, comm",
    ),
    "training.mode": "measure (apply_training_mode: frozen parameters hold no grad / state)",
    **dict.fromkeys(
        ("training.seq_len", "training.local_batch_size", "training.grad_accum_steps"),
        "activations, fsdp_buffers (no-sync accumulation), comm",
    ),
    "training.global_batch_size": "estimate (grad_accum_steps derived at the world size, "
    "JobConfig.at_dp, as the recipe), layouts (the global batch --compare holds)",
    "training.loss_chunks": "activations.loss_bytes (one chunk of logits, engram/train/loss.py)",
    "optimizer.name": "measure (AdamW: two fp32 moments)",
    "optimizer.table_optimizer": "tables (engram/config/table_optimizers.py)",
    "engram.table_location": "measure (host_table_bytes), estimate (rows on device, host link), "
    "nvme (drives, host cache, I/O per step), table_checkpoint (bytes per save)",
    "engram.nvme_host_cache_gib": "nvme (host memory per node, pinned pages, reuse)",
    "engram.nvme_dirs": "nvme (the drives are --nvme_drives_per_node, an assumption)",
    "checkpoint.interval": "table_checkpoint (rows touched since the previous save)",
    "engram.host_memory_gib": "results (host_fits: host tables per node)",
    **dict.fromkeys(
        (
            "parallelism.dp_replicate",
            "parallelism.dp_shard",
            "parallelism.tp",
            "parallelism.pp",
            "parallelism.tp_sequence_parallel",
            "parallelism.tp_loss_parallel",
        ),
        "measure (the fake mesh), activations and comm (axis_divisors)",
    ),
    "parallelism.cp": "measure (FSDP over dp_shard x cp, tables over dp x cp x tp), activations, "
    "comm (axis_divisors), pipeline stages and host tables at cp",
    "parallelism.cp_method": "activations (K / V held per method, all-gather K/V's masks), comm",
    "parallelism.fsdp_reshard_after_forward": "fsdp_buffers, comm",
    "parallelism.engram_table_dedup": "comm (counted without dedup: an upper bound)",
    "parallelism.engram_a2a_dtype": "comm",
    "parallelism.cpu_offload": "measure (host bytes)",
    "parallelism.mixed_precision_param": "fsdp_buffers, activations",
    "parallelism.mixed_precision_reduce": "fsdp_buffers, comm",
    "activation_checkpoint.mode": "activations, comm (recompute)",
    "activation_checkpoint.selective_every": "activations, comm (recompute)",
    "checkpoint.enable": "measure (async staging copy)",
    "checkpoint.async_mode": "measure (async staging copy), table_checkpoint (NVMe tables: "
    "a streamed or a copied save)",
    **dict.fromkeys(
        (
            "pipeline.schedule",
            "pipeline.microbatches",
            "pipeline.virtual_stages",
            "pipeline.layers_per_stage",
            "pipeline.split_points",
        ),
        "measure (split_stages), schedule (micro-batches in flight), comm",
    ),
    **dict.fromkeys(
        ("float8.enable", "float8.recipe", "float8.filter_fqns", "float8.emulate"),
        "activations.float8_cast_bytes",
    ),
    **dict.fromkeys(("compile.enable", "compile.backend"), "estimated as eager"),
    **dict.fromkeys(
        ("lora.rank", "lora.target_modules", "lora.frozen_dtype"),
        "measure (built adapters, held dtype); adapter activations (B x T x rank) not counted",
    ),
    "lora.dropout": "estimated without the dropout masks of the adapters' inputs",
    "checkpoint.trainable_only": "measure (async staging counts the whole model: upper bound)",
    **dict.fromkeys(
        ("data.eval_exact_match", "data.eval_max_new_tokens"),
        "not counted: the evaluation's greedy decode between steps (one prompt's KV cache)",
    ),
}

MODELLED_VALUES = {  # setting -> the values the planner models (others are refused)
    "training.mode": ("full", "engram_only", "lora"),
    # Without loss parallel the logits are all-gathered; the planner divides them by tp.
    "parallelism.tp_loss_parallel": (True,),
    "engram.table_location": ("device", "host", "nvme"),
}

NO_MEMORY_EFFECT = frozenset(
    {
        *("job.config_file", "job.dump_folder", "job.run_name", "job.description", "job.seed"),
        "job.deterministic",
        "job.cpu_affinity",  # which host CPUs the rank's threads run on
        *("comm.init_timeout_s", "comm.train_timeout_s"),  # how long a collective may wait
        "compile.allow_on_npu",  # an opt-in; compile itself is estimated as eager
        "engram.nvme_create_dirs",  # whether a missing page-file directory is created at start
        "engram.nvme_probe_s",  # seconds of 4 KiB reads at start, into one small buffer
        "metrics.telemetry",  # a few float sums per Engram layer, read on log steps
        "lora.alpha",  # a scale factor
        "lora.init_a",  # the adapters' initial values, not their size
        "model.hf_checkpoint",  # loaded into the same parameters
        *("engram.seed", "engram.pad_id", "engram.compress_tokenizer"),
        *("engram.respect_doc_boundaries", "engram.init", "engram.table_init_std"),
        *("training.steps", "training.max_norm", "training.max_nonfinite_steps"),
        *("data.dataset", "data.path", "data.num_workers", "data.synthetic_num_entities"),
        *("data.synthetic_seed", "data.eval_every", "data.eval_batches", "data.sources"),
        # fine-tuning data: which tokens and rows the loader builds, not their shape [B, T]
        *("data.synthetic_part", "data.synthetic_pretrain_fraction", "data.train_on"),
        *("data.pack", "data.overflow", "data.chat_template", "data.chat_template_kwargs"),
        *("export.folder", "export.lora"),  # one process after training, on the host
        *("optimizer.lr", "optimizer.betas", "optimizer.eps", "optimizer.weight_decay"),
        *("optimizer.engram_lr_mult", "optimizer.table_lr_mult", "optimizer.table_weight_decay"),
        "optimizer.table_lazy",  # read into table_optimizer, then false
        *("lr_scheduler.warmup_steps", "lr_scheduler.decay_type", "lr_scheduler.min_lr_ratio"),
        *("checkpoint.folder", "checkpoint.keep_latest_k"),
        *("checkpoint.load_step", "checkpoint.on_damaged"),
        "checkpoint.table_full_every",  # what a save writes to disk, not what a device holds
        *("metrics.log_freq", "metrics.enable_tensorboard", "metrics.tb_folder"),
        "metrics.peak_tflops",  # the MFU denominator in the log
        # host memory only
        *("profiling.enable_profiling", "profiling.profile_freq", "profiling.traces_folder"),
        "profiling.memory_snapshot",
        # Read only by recipes/train_deepspeed.py; the planner models recipes/train.py, whose
        # FSDP-over-all-ranks estimate docs/deepspeed.md uses for ZeRO-3 (not modelled itself).
        *("deepspeed.zero_stage", "deepspeed.offload_optimizer", "deepspeed.offload_param"),
        "deepspeed.config_json",
    }
)


def settings(cfg: JobConfig) -> dict[str, object]:
    """Every setting of the config: "section.key" -> value."""
    return {
        f"{section.name}.{f.name}": getattr(getattr(cfg, section.name), f.name)
        for section in dataclasses.fields(cfg)
        for f in dataclasses.fields(getattr(cfg, section.name))
    }


def parallelize_steps() -> list[str]:
    """The steps of parallelize_model: the apply_* functions of parallelisms/parallelize.py."""
    from parallelisms import parallelize

    return sorted(n for n, v in vars(parallelize).items() if n.startswith("apply_") and callable(v))


def check_modelled(cfg: JobConfig) -> None:
    """Refuse, by name, a parallelize_model step or a setting the planner does not model."""
    steps = [s for s in parallelize_steps() if s not in STEPS]
    if steps:
        raise ConfigError(
            f"the memory planner does not model parallelize_model step(s) {', '.join(steps)}: "
            "model their memory in planner/ and register them in planner/registry.py STEPS"
        )
    default = settings(JobConfig())
    for name, value in settings(cfg).items():
        if name in MODELLED_VALUES and value not in MODELLED_VALUES[name]:
            raise ConfigError(
                f"the memory planner does not model {name} = {value!r} (it models "
                f"{', '.join(map(repr, MODELLED_VALUES[name]))}): estimate with a modelled "
                "value, or model it in planner/ and register it in planner/registry.py"
            )
        if name not in MODELLED and name not in NO_MEMORY_EFFECT and value != default[name]:
            raise ConfigError(
                f"the memory planner does not model {name} = {value!r}: leave it at its "
                f"default ({default[name]!r}) to estimate, or model it in planner/ and register "
                "it in planner/registry.py"
            )
