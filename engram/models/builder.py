"""Config -> model: resolve the shape, validate the Engram placement, build (on meta by default)."""

from __future__ import annotations

import logging

import torch

from engram.config import Engram as EngramConfig
from engram.config import JobConfig
from engram.config import Model as ModelConfig
from engram.hashing.ngram import NgramHasher, engram_table_rows
from engram.models.args import ModelArgs, get_model_args
from engram.models.hf_config import HF_FLAVOR, check_flavor_against_hf, hf_flavor_args
from engram.models.lora import add_lora_adapters
from engram.models.transformer import Transformer

logger = logging.getLogger("engram")


def flavor_args(model_cfg: ModelConfig) -> ModelArgs:
    """The configured shape before the vocabulary is resolved: the named flavor, or with
    flavor "hf" the shape of model.hf_checkpoint's config.json (only that file is read)."""
    if model_cfg.flavor == HF_FLAVOR:
        return hf_flavor_args(model_cfg.name, model_cfg.hf_checkpoint)
    return get_model_args(model_cfg.name, model_cfg.flavor)


def model_args_for(
    model_cfg: ModelConfig, vocab_size: int, max_seq_len: int | None = None
) -> ModelArgs:
    """The flavor's shape with the vocabulary resolved.

    flavor "hf": the shape of model.hf_checkpoint's config.json. Embedding rows: model.vocab_size
    if set, else the flavor's (big flavors), else `vocab_size` (the tokenizer's size; debug
    flavors). A tokenizer larger than the embedding is an error. A named flavor must match
    hf_checkpoint's config.json (model.hf_config_mismatch).
    """
    args = flavor_args(model_cfg)
    rows = model_cfg.vocab_size or args.vocab_size or vocab_size
    if rows <= 0:
        raise ValueError(
            f"{model_cfg.name}/{model_cfg.flavor} has no fixed vocabulary: pass the tokenizer's "
            "vocab size or set model.vocab_size"
        )
    if vocab_size > rows:
        raise ValueError(
            f"the tokenizer has {vocab_size} tokens but the model has {rows} embedding rows: "
            "set model.vocab_size >= the tokenizer size, or use the model's own tokenizer"
        )
    changes: dict[str, object] = {
        "vocab_size": rows,
        "attn_mask_type": model_cfg.attn_mask_type,
        "attn_backend": model_cfg.attn_backend,
    }
    if max_seq_len is not None:
        changes["max_seq_len"] = max(max_seq_len, 1)
    args = args.replace(**changes)
    if model_cfg.hf_checkpoint and model_cfg.flavor != HF_FLAVOR:
        for diff in check_flavor_against_hf(
            args, model_cfg.name, model_cfg.flavor, model_cfg.hf_checkpoint,
            model_cfg.hf_config_mismatch,
        ):  # fmt: skip
            logger.warning("%s (model.hf_config_mismatch = 'warn')", diff)
    return args


def validate_engram(engram_cfg: EngramConfig, args: ModelArgs, table_rows: dict[int, int]) -> None:
    if engram_cfg.hc_mult != 1:
        raise ValueError(
            f"engram.hc_mult = {engram_cfg.hc_mult}, but these dense models have a single "
            "residual stream: set engram.hc_mult = 1"
        )
    bad = [i for i in engram_cfg.layer_ids if not 0 <= i < args.n_layers]
    if bad:
        raise ValueError(
            f"engram.layer_ids {bad} out of range: this model has {args.n_layers} layers, valid "
            f"ids are 0..{args.n_layers - 1}"
        )
    missing = [i for i in engram_cfg.layer_ids if table_rows.get(i, 0) <= 0]
    if missing:
        raise ValueError(
            f"table_rows has no positive row count for Engram layers {missing} "
            "(compute it with NgramHasher(...).table_rows)"
        )


def build_model(
    model_cfg: ModelConfig,
    engram_cfg: EngramConfig,
    vocab_size: int,
    table_rows: dict[int, int],
    device: torch.device | str = "meta",
    max_seq_len: int | None = None,
) -> Transformer:
    """Build the float32 model on `device` (meta: no memory; then to_empty() + init_weights(seed)).

    With engram.enabled false (or no layer ids) the plain backbone is built.
    """
    args = model_args_for(model_cfg, vocab_size, max_seq_len)
    use_engram = engram_cfg.enabled and bool(engram_cfg.layer_ids)
    if use_engram:
        validate_engram(engram_cfg, args, table_rows)
    with torch.device(device):
        model = Transformer(args, engram_cfg if use_engram else None, table_rows)
    return model


def build_model_from_config(
    cfg: JobConfig,
    vocab_size: int,
    device: torch.device | str = "meta",
    max_seq_len: int | None = None,
) -> Transformer:
    """The job's model (on `device`, uninitialised). It needs only the Engram table sizes, from
    the config (`engram_table_rows`: the hasher's prime search without a tokenizer), never the
    hasher; the RoPE table covers max(training.seq_len, max_seq_len) positions."""
    table_rows = engram_table_rows(cfg.engram) if cfg.engram.enabled else {}
    seq = max(cfg.training.seq_len, max_seq_len or 0)
    return build_model(cfg.model, cfg.engram, vocab_size, table_rows, device, seq)


def build_hasher(cfg: JobConfig, tokenizer) -> NgramHasher | None:
    """The job's Engram hasher (None without Engram), for the data loader and generation."""
    if not cfg.engram.enabled:
        return None
    return NgramHasher.from_config(cfg.engram, tokenizer, tokenizer.vocab_size)


def build_from_config(
    cfg: JobConfig, tokenizer, device: torch.device | str = "meta", max_seq_len: int | None = None
) -> tuple[Transformer, NgramHasher | None]:
    """Both of the above (tests, generation): the model and its hasher."""
    hasher = build_hasher(cfg, tokenizer)
    model = build_model_from_config(cfg, tokenizer.vocab_size, device, max_seq_len)
    if hasher is not None:  # one prime search, two paths: they must agree
        built = {i: b.table.weight.shape[0] for i, b in model.engram_blocks().items()}
        if built != hasher.table_rows:
            raise ValueError(f"table rows {built} differ from the hasher's {hasher.table_rows}")
    return model, hasher


def build_for_inference(
    cfg: JobConfig, tokenizer, max_seq_len: int, device: torch.device | str = "cpu"
) -> tuple[Transformer, NgramHasher | None]:
    """The training recipe's model (LoRA adapters in lora mode), unsharded on `device`,
    initialised with job.seed, in eval
    mode (generation, export). `max_seq_len` sizes the RoPE table."""
    model, hasher = build_from_config(cfg, tokenizer, max_seq_len=max_seq_len)
    if cfg.training.mode == "lora":  # the adapters a lora run's checkpoint holds
        add_lora_adapters(model, cfg.lora)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.job.seed)
    model.eval()
    return model, hasher
