"""config.json -> model shape (model.flavor = "hf"), transformers 4 and 5 layouts, unsupported
fields as errors naming the field, and a named flavor vs the folder's config.json."""

from __future__ import annotations

import json
import logging

import pytest

from engram.config import ConfigError, config_from_dict
from engram.models.args import RopeScaling, get_model_args
from engram.models.builder import model_args_for
from engram.models.hf_config import HFConfigError, args_from_hf_config

# Llama-3.2-3B's config.json as transformers 4 writes it.
LLAMA32_3B_V4 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3",
    },
    "tie_word_embeddings": True, "vocab_size": 128256, "attention_bias": False,
    "mlp_bias": False,
}  # fmt: skip


def _v5(config: dict) -> dict:
    """The same config as transformers 5 writes it: rope_theta and scaling in rope_parameters."""
    out = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    scaling = config.get("rope_scaling") or {"rope_type": "default"}
    out["rope_parameters"] = {**scaling, "rope_theta": config["rope_theta"]}
    out["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    return out


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_llama32_3b_both_layouts(layout):
    config = LLAMA32_3B_V4 if layout == "v4" else _v5(LLAMA32_3B_V4)
    family, args = args_from_hf_config(config)
    assert family == "llama3"
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim) == (
        3072, 28, 24, 8, 8192
    )  # fmt: skip
    assert (args.head_dim, args.vocab_size, args.norm_eps, args.rope_theta) == (
        128, 128256, 1e-5, 500000.0
    )  # fmt: skip
    assert args.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert args.tie_embeddings and not args.qkv_bias and not args.qk_norm


def test_named_flavors_equal_their_config():
    """The shipped flavors are what args_from_hf_config reads from the published configs."""
    llama31_8b = {
        **LLAMA32_3B_V4, "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_hidden_layers": 32, "tie_word_embeddings": False,
        "rope_scaling": {**LLAMA32_3B_V4["rope_scaling"], "factor": 8.0},
    }  # fmt: skip
    qwen25_7b = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28,
        "tie_word_embeddings": False, "vocab_size": 152064, "hidden_act": "silu",
    }  # fmt: skip
    qwen3_8b = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000, "rope_scaling": None, "tie_word_embeddings": False,
        "vocab_size": 151936, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None,
    }  # fmt: skip
    for (name, flavor), config in [
        (("llama3", "8B"), llama31_8b),
        (("qwen2", "7B"), qwen25_7b),
        (("qwen3", "8B"), qwen3_8b),
    ]:
        for layout in (config, _v5(config)):
            family, args = args_from_hf_config(layout, max_seq_len=8192)
            assert family == name
            assert args == get_model_args(name, flavor), (name, flavor)


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"architectures": ["MistralForCausalLM"]}, "architectures"),
        ({"architectures": None, "model_type": "gemma"}, "model_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_field_is_named(changes, field):
    with pytest.raises(HFConfigError, match=field):
        args_from_hf_config({**LLAMA32_3B_V4, **changes})


def _write(folder, config) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_hf_flavor_reads_the_folder(tmp_path):
    folder = _write(tmp_path / "qwen3", {**LLAMA32_3B_V4, "architectures": ["Qwen3ForCausalLM"]})
    cfg = config_from_dict({"model": {"name": "qwen3", "flavor": "hf", "hf_checkpoint": folder}})
    args = model_args_for(cfg.model, 1000, max_seq_len=64)
    assert args.qk_norm and args.tie_embeddings and args.vocab_size == 128256
    assert args.max_seq_len == 64
    # model.name must be the folder's family, and flavor hf needs a folder.
    with pytest.raises(HFConfigError, match="set model.name = 'qwen3'"):
        model_args_for(
            config_from_dict({"model": {"flavor": "hf", "hf_checkpoint": folder}}).model, 1000
        )
    with pytest.raises(ConfigError, match="model.hf_checkpoint"):
        config_from_dict({"model": {"flavor": "hf"}})
    with pytest.raises(HFConfigError, match="config.json does not exist"):
        model_args_for(
            config_from_dict(
                {"model": {"flavor": "hf", "hf_checkpoint": str(tmp_path / "none")}}
            ).model,
            1000,
        )


class _Records(logging.Handler):
    """Collects engram warnings (init_logging stops propagation, so caplog may see nothing)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_named_flavor_mismatch_is_an_error_unless_warn(tmp_path):
    """llama3/8B (no tie, rope factor 8) pointed at a Llama-3.2-3B folder."""
    folder = _write(tmp_path / "l32", _v5(LLAMA32_3B_V4))
    raw = {"model": {"name": "llama3", "flavor": "8B", "hf_checkpoint": folder}}
    with pytest.raises(HFConfigError) as info:
        model_args_for(config_from_dict(raw).model, 1000)
    msg = str(info.value)
    for fragment in ("hidden_size", "tie_word_embeddings", "rope_scaling", "model.flavor = 'hf'"):
        assert fragment in msg, msg
    raw["model"]["hf_config_mismatch"] = "warn"
    records, log = _Records(), logging.getLogger("engram")
    log.addHandler(records)
    try:
        args = model_args_for(config_from_dict(raw).model, 1000)
    finally:
        log.removeHandler(records)
    assert args == get_model_args("llama3", "8B").replace(max_seq_len=args.max_seq_len)
    assert any("tie_word_embeddings" in m for m in records.messages), records.messages
    # A folder whose config.json agrees loads silently.
    same = _write(tmp_path / "l31", {**LLAMA32_3B_V4, "hidden_size": 4096,
                  "intermediate_size": 14336, "num_attention_heads": 32,
                  "num_hidden_layers": 32, "tie_word_embeddings": False,
                  "rope_scaling": {**LLAMA32_3B_V4["rope_scaling"], "factor": 8.0},
                  "max_position_embeddings": 8192})  # fmt: skip
    raw["model"].update(hf_checkpoint=same, hf_config_mismatch="error")
    model_args_for(config_from_dict(raw).model, 1000, max_seq_len=8192)


def test_estimator_sizes_an_hf_config_without_weights(tmp_path):
    """The memory estimator needs only config.json for flavor 'hf' (no weights, no tokenizer
    file): Llama-3.2-3B (tied) has its published 3,212,749,824 parameters."""
    from launcher import run_isolated

    try:
        from planner.estimate import estimate
    except ImportError:  # before the estimator moves to scripts/
        from recipes.estimate_memory import estimate

    folder = _write(tmp_path / "l32", _v5(LLAMA32_3B_V4))
    raw = {
        "model": {
            "name": "llama3", "flavor": "hf", "hf_checkpoint": folder,
            "tokenizer_path": str(tmp_path / "not_here" / "tokenizer.json"),
        },
        "engram": {"enabled": False},
        "parallelism": {"dp_shard": 8},
    }  # fmt: skip
    est = run_isolated(estimate, config_from_dict(raw), 8, ranks=[0])
    assert est.global_params == 3_212_749_824
