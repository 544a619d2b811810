"""What recipes/train_deepspeed.py does with every config setting, by name.

Every setting of JobConfig ("section.key") is in exactly one of:

- HONOURED: the recipe applies it as recipes/train.py does (or as docs/deepspeed.md says);
- REFUSED: setting -> why; `check_settings` refuses it at start when it is not at its default;
- IRRELEVANT: setting -> why it has no effect here (e.g. the pipeline section, since
  parallelism.pp > 1 is refused).

tests/test_parallelisms_deepspeed.py checks that every setting of JobConfig is classified, so a
new setting fails CI until it is classified here (planner/registry.py does the same for the
memory planner): none is ignored by default.
"""

from __future__ import annotations

import json

from engram.config import ConfigError, JobConfig

HONOURED = frozenset(
    {
        *("job.config_file", "job.dump_folder", "job.run_name", "job.description", "job.seed"),
        *("job.device", "job.deterministic", "job.cpu_affinity"),
        *("model.name", "model.flavor", "model.tokenizer_path", "model.vocab_size"),
        *("model.hf_checkpoint", "model.hf_config_mismatch"),
        # the batch's segment_ids reach the model through engine_step (model_inputs)
        *("model.attn_mask_type", "model.attn_backend"),
        *("engram.enabled", "engram.layer_ids", "engram.max_ngram", "engram.n_head_per_ngram"),
        *("engram.vocab_size_per_ngram", "engram.n_embed_per_ngram", "engram.kernel_size"),
        *("engram.hc_mult", "engram.seed", "engram.pad_id", "engram.compress_tokenizer"),
        *("engram.respect_doc_boundaries", "engram.use_bias", "engram.init"),
        "engram.table_init_std",
        *("training.mode", "training.seq_len", "training.local_batch_size"),
        *("training.grad_accum_steps", "training.steps", "training.max_norm"),
        *("training.max_nonfinite_steps", "training.global_batch_size"),
        *("data.dataset", "data.path", "data.num_workers", "data.synthetic_num_entities"),
        *("data.synthetic_seed", "data.eval_every", "data.eval_batches", "data.sources"),
        # fine-tuning data: which tokens and rows the loader builds, not their shape [B, T]
        *("data.synthetic_part", "data.synthetic_pretrain_fraction", "data.train_on"),
        *("data.pack", "data.overflow", "data.chat_template", "data.chat_template_kwargs"),
        # run_recipe exports the engine's last step (engram/hf/export_run.py reads DeepSpeed steps)
        *("export.folder", "export.lora"),
        *("optimizer.name", "optimizer.lr", "optimizer.betas", "optimizer.eps"),
        *("optimizer.weight_decay", "optimizer.engram_lr_mult", "optimizer.table_lr_mult"),
        *("optimizer.table_weight_decay", "optimizer.table_lazy", "optimizer.table_optimizer"),
        *("lr_scheduler.warmup_steps", "lr_scheduler.decay_type", "lr_scheduler.min_lr_ratio"),
        # dp_shard: ZeRO shards over every rank (dp_replicate > 1 is refused)
        "parallelism.dp_shard",
        # the row-sharded tables, as in train.py (parallelize.shard_engram_tables)
        *("parallelism.engram_table_dedup", "parallelism.engram_a2a_dtype"),
        # bf16.enabled and communication_data_type of the ds_config (build_ds_config)
        *("parallelism.mixed_precision_param", "parallelism.mixed_precision_reduce"),
        *("activation_checkpoint.mode", "activation_checkpoint.selective_every"),
        # the step folder: the tables' DCP shards (async when asked) + the engine's own files
        *("checkpoint.enable", "checkpoint.folder", "checkpoint.interval"),
        *("checkpoint.keep_latest_k", "checkpoint.load_step", "checkpoint.on_damaged"),
        "checkpoint.async_mode",
        *("metrics.log_freq", "metrics.enable_tensorboard", "metrics.tb_folder"),
        "metrics.peak_tflops",
        "metrics.telemetry",  # EngineStep is TrainStep: the same log-step statistics
        *("profiling.enable_profiling", "profiling.profile_freq", "profiling.traces_folder"),
        "profiling.memory_snapshot",
        *("deepspeed.zero_stage", "deepspeed.offload_optimizer", "deepspeed.offload_param"),
        "deepspeed.config_json",
        *("lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules"),
        *("lora.frozen_dtype", "lora.init_a"),
        *("comm.init_timeout_s", "comm.train_timeout_s"),
    }
)

REFUSED = {
    "parallelism.pp": "DeepSpeed ZeRO-2/3 does not compose with pipeline parallelism; use "
    "recipes/train.py (FSDP2 x PP)",
    "parallelism.tp": "tensor parallelism is not wired into this variant; use recipes/train.py "
    "(FSDP2 x TP)",
    "parallelism.cp": "context parallelism is not wired into this variant; use recipes/train.py "
    "(FSDP2 x CP)",
    "parallelism.dp_replicate": "ZeRO shards over every rank (no HSDP replica groups here); set "
    "it to 1 or use recipes/train.py",
    "parallelism.cpu_offload": "that is FSDP2's offload: use deepspeed.offload_optimizer / "
    "deepspeed.offload_param",
    "parallelism.fsdp_reshard_after_forward": "that is FSDP2's; ZeRO-3 re-gathers by DeepSpeed's "
    "own stage3_* keys (deepspeed.config_json)",
    "float8.enable": "float8 is not wired into this variant",
    "compile.enable": "torch.compile is not wired into this variant (DeepSpeed's ZeRO-3 hooks are "
    "untested under it here)",
    "engram.table_location": "host / NVMe tables' prefetch and host-update waits are wired "
    'into recipes/train.py only; use it, or table_location = "device"',
    "training.loss_chunks": "the chunked loss applies the output head outside the model's "
    "forward, where ZeRO-3 has not gathered it; set it to 1 or use recipes/train.py",
    "checkpoint.table_full_every": "the engine saves every weight in full at every step; "
    "incremental table checkpoints are wired into recipes/train.py only; set it to 1 or use it",
    "data.eval_exact_match": "the exact-match evaluation decodes with the FSDP model of "
    "recipes/train.py; run scripts/eval_qa.py on the step (it reads DeepSpeed steps)",
    "checkpoint.trainable_only": "the engine's checkpoint holds every weight (DeepSpeed saves the "
    "whole module); set it to false, or train with recipes/train.py to save only the trained "
    "weights",
}

IRRELEVANT = {
    # The config refuses them unless engram.table_location = "nvme", which is refused above
    # (engram/config/model.py Engram: the same check for both recipes).
    **dict.fromkeys(
        (
            "engram.nvme_dirs",
            "engram.nvme_host_cache_gib",
            "engram.nvme_create_dirs",
            "engram.nvme_probe_s",
        ),
        'read only with engram.table_location = "nvme": refused by the config otherwise',
    ),
    **dict.fromkeys(
        (
            "pipeline.schedule",
            "pipeline.microbatches",
            "pipeline.virtual_stages",
            "pipeline.layers_per_stage",
            "pipeline.split_points",
        ),
        "read only at parallelism.pp > 1, refused here",
    ),
    **dict.fromkeys(
        ("parallelism.tp_sequence_parallel", "parallelism.tp_loss_parallel"),
        "read only at parallelism.tp > 1, refused here",
    ),
    "parallelism.cp_method": "read only at parallelism.cp > 1, refused here",
    **dict.fromkeys(
        ("float8.recipe", "float8.filter_fqns", "float8.emulate"),
        "read only with float8.enable, refused here",
    ),
    **dict.fromkeys(
        ("compile.backend", "compile.allow_on_npu"), "read only with compile.enable, refused here"
    ),
    "engram.host_memory_gib": 'read only with engram.table_location = "host", refused here',
    "data.eval_max_new_tokens": "read only with data.eval_exact_match, refused here",
}


def settings(cfg: JobConfig) -> dict[str, object]:
    """Every setting of the config: "section.key" -> value."""
    return {f"{s}.{k}": v for s, section in cfg.to_dict().items() for k, v in section.items()}


def check_settings(cfg: JobConfig) -> None:
    """Refuse, by name, a REFUSED setting that is not at its default."""
    default = settings(JobConfig())
    for name, value in settings(cfg).items():
        if name in REFUSED and value != default[name]:
            raise ConfigError(
                f"{name} = {json.dumps(value)} is not supported by recipes/train_deepspeed.py: "
                f"{REFUSED[name]}"
            )
