"""A Hugging Face config.json -> (model.name, ModelArgs), for transformers 4 and 5 layouts.

    family, args = args_from_hf_config(read_hf_config("/models/Qwen2.5-3B"))

transformers 4 writes `rope_theta` and `rope_scaling` at the top level; transformers 5 writes
them inside `rope_parameters` (`{"rope_type": ..., "rope_theta": ..., "factor": ...}`), possibly
nested per layer type. Everything the model code cannot compute (another rope type, sliding
window attention, another activation, biases on o_proj or the MLP, another architecture) is an
HFConfigError naming the field, so a checkpoint of another function never loads silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engram.models.args import ModelArgs, RopeScaling

CONFIG_FILE = "config.json"
# architectures[0] / model_type -> our model.name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # engram/hf/export.py's transformers export (modeling_engram.py) on these backbones
    "EngramLlamaForCausalLM": "llama3",
    "EngramQwen2ForCausalLM": "qwen2",
    "EngramQwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = {
    "llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3",
    "engram_llama": "llama3", "engram_qwen2": "qwen2", "engram_qwen3": "qwen3",
}  # fmt: skip
# RoPE types rope_inv_freq computes ("default": no scaling).
ROPE_TYPES = ("default", "llama3")
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# Fields compared between a named flavor and config.json (ModelArgs field names).
COMPARED = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim", "vocab_size", "norm_eps",
    "rope_theta", "rope_scaling", "qkv_bias", "qk_norm", "tie_embeddings",
)  # fmt: skip
# Their config.json names, for messages.
HF_NAMES = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size", "head_dim": "head_dim",
    "vocab_size": "vocab_size", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling", "qkv_bias": "model_type/attention_bias",
    "qk_norm": "model_type", "tie_embeddings": "tie_word_embeddings",
}  # fmt: skip


class HFConfigError(ValueError):
    """config.json describes a model this code cannot compute, or is unreadable."""


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise HFConfigError(
            f"{path} does not exist: model.flavor = 'hf' reads the shape from the config.json of "
            "model.hf_checkpoint (the folder save_pretrained / huggingface-cli download writes)"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise HFConfigError(f"{path} is not a JSON object")
    return config


def family_of(config: dict[str, Any]) -> str:
    """Our model.name for the config's architecture (architectures[0], else model_type)."""
    archs = config.get("architectures") or []
    if archs:
        if archs[0] not in ARCHITECTURES:
            raise HFConfigError(
                f"architectures = {archs} is not supported: this model code computes "
                f"{', '.join(ARCHITECTURES)} (dense Llama / Qwen2 / Qwen2.5 / Qwen3)"
            )
        return ARCHITECTURES[archs[0]]
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFConfigError(
            f"model_type = {model_type!r} is not supported: this model code computes "
            f"{', '.join(MODEL_TYPES)}"
        )
    return MODEL_TYPES[model_type]


def rope_of(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope scaling) from either layout; an unsupported rope type is an error."""
    params = config.get("rope_parameters")
    where = "rope_parameters"
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # transformers 5, one dict per layer type: every layer here is full attention.
        where = "rope_parameters.full_attention"
        params = params.get("full_attention")
    if not params:
        params, where = config.get("rope_scaling") or {}, "rope_scaling"
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise HFConfigError(
            f"{where}.rope_type = {rope_type!r} is not supported: the model code computes RoPE "
            f"types {', '.join(ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFConfigError(f"partial_rotary_factor = {partial} is not supported (only 1.0)")
    if rope_type == "default":
        return theta, None
    original = params.get("original_max_position_embeddings", config.get("max_position_embeddings"))
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    except (KeyError, TypeError) as e:
        raise HFConfigError(f"{where} of rope_type 'llama3' lacks {e}") from e
    return theta, scaling


def _check_function(config: dict[str, Any], family: str) -> None:
    """Fields that would make the checkpoint compute something this model code does not."""
    act = config.get("hidden_act", config.get("hidden_activation", "silu"))
    if act != "silu":
        raise HFConfigError(f"hidden_act = {act!r} is not supported: the MLP is SwiGLU (silu)")
    if config.get("use_sliding_window"):
        raise HFConfigError(
            "use_sliding_window = true is not supported: attention here is full causal attention"
        )
    sliding = [t for t in config.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise HFConfigError(
            f"layer_types has {sorted(set(sliding))} layers: only full_attention is supported"
        )
    if config.get("mlp_bias"):
        raise HFConfigError("mlp_bias = true is not supported: the MLP has no biases")
    if family != "qwen2" and config.get("attention_bias"):
        raise HFConfigError(
            "attention_bias = true is not supported (it also puts a bias on o_proj): only "
            "Qwen2's q/k/v biases are"
        )


def args_from_hf_config(config: dict[str, Any], max_seq_len: int = 4096) -> tuple[str, ModelArgs]:
    """(model.name, ModelArgs) of the checkpoint; HFConfigError names any unsupported field."""
    family = family_of(config)
    absent = [k for k in (*_REQUIRED, "vocab_size") if config.get(k) is None]
    if absent:
        raise HFConfigError(f"config.json lacks {', '.join(absent)}")
    _check_function(config, family)
    theta, scaling = rope_of(config)
    try:
        args = ModelArgs(
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=int(config["num_attention_heads"]),
            n_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            ffn_dim=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            head_dim=config.get("head_dim"),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_seq_len=max_seq_len,
        )
    except ValueError as e:
        raise HFConfigError(f"config.json gives an invalid shape: {e}") from e
    return family, args


def config_differences(args: ModelArgs, family: str, config: dict[str, Any]) -> list[str]:
    """How `args` (model.name `family`) differs from the checkpoint's config.json, one line each."""
    theirs_family, theirs = args_from_hf_config(config, args.max_seq_len)
    diffs = []
    if theirs_family != family:
        diffs.append(f"architecture is model.name {theirs_family!r}, the model is {family!r}")
    for field in COMPARED:
        mine, their = getattr(args, field), getattr(theirs, field)
        if field == "vocab_size" and config.get("vocab_size") is None:
            continue
        if mine != their:
            diffs.append(
                f"{HF_NAMES[field]}: config.json gives {field} = {their}, model has {mine}"
            )
    return diffs


# ----------------------------------------------------------------------------- [model] section

HF_FLAVOR = "hf"


def hf_flavor_args(name: str, folder: str | Path) -> ModelArgs:
    """model.flavor = "hf": the shape of the checkpoint in `folder`, whose family must be `name`."""
    config = read_hf_config(folder)
    try:
        family, args = args_from_hf_config(config)
    except HFConfigError as e:
        raise HFConfigError(f"{Path(folder) / CONFIG_FILE}: {e}") from e
    if family != name:
        raise HFConfigError(
            f"{Path(folder) / CONFIG_FILE} describes a {family} model but model.name = {name!r}: "
            f"set model.name = {family!r}"
        )
    return args


def check_flavor_against_hf(
    args: ModelArgs, name: str, flavor: str, folder: str | Path, on_mismatch: str
) -> list[str]:
    """A named flavor vs the config.json of model.hf_checkpoint (when it has one): an error, or
    with on_mismatch = "warn" the differences returned for the caller to log."""
    if not (Path(folder) / CONFIG_FILE).is_file():
        return []
    path = Path(folder) / CONFIG_FILE
    try:
        diffs = config_differences(args, name, read_hf_config(folder))
    except HFConfigError as e:
        diffs = [str(e)]
    if diffs and on_mismatch != "warn":
        raise HFConfigError(
            f"model {name}/{flavor} is not the model of {path}:\n  "
            + "\n  ".join(diffs)
            + "\nFix: set model.flavor = 'hf' to take the shape from config.json (and model.name "
            "to its family), or model.hf_config_mismatch = 'warn' to load the weights into this "
            "flavor anyway"
        )
    return [f"{path}: {d}" for d in diffs]
