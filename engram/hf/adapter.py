"""State-dict names: ours <-> Hugging Face Llama / Qwen2 / Qwen3.

Our RoPE is HF's rotate-half convention, so q/k weights map without any row permutation. Engram
parameters have no HF counterpart: in engram.safetensors they travel under an `engram.` prefix on
our own name (e.g. `engram.layers.1.engram.table.weight`); in the transformers export
(engram/hf/remote/modeling_engram.py) they sit in their decoder layer,
`model.layers.1.engram.table.weight`, beside the tokenizer compression table `engram_hash.lookup`.
"""

from __future__ import annotations

import re

import torch

from engram.models.args import ModelArgs

ENGRAM_PREFIX = "engram."
HASH_LOOKUP = "engram_hash.lookup"  # the export's compression table (a buffer, not a weight)

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_TOP_INV = {v: k for k, v in _TOP.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_ENGRAM = re.compile(r"^model\.(layers\.\d+\.engram\..+)$")
# Buffers some HF checkpoints carry; recomputed on our side.
_HF_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


def hf_module_name(ours: str) -> str:
    """`layers.<i>.<our module path>` -> HF's `model.layers.<i>.<module path>` (a module, not a
    parameter: PEFT's adapter keys hang off it)."""
    m = re.match(r"^layers\.(\d+)\.(.+)$", ours)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(f"no Hugging Face name for module {ours!r}")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our names -> HF names. Tied models omit lm_head.weight (as HF checkpoints do)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in sd.items():
        if ".engram." in f".{name}":
            out[ENGRAM_PREFIX + name] = value
            continue
        if name in _TOP:
            if name == "output.weight" and args.tie_embeddings:
                continue
            out[_TOP[name]] = value
            continue
        m = _OURS_LAYER.match(name)
        if m is None or m.group(2) not in _LAYER:
            raise KeyError(f"no Hugging Face name for parameter {name!r}")
        layer, module, kind = m.groups()
        out[f"model.layers.{layer}.{_LAYER[module]}.{kind}"] = value
    return out


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names -> our names. Unknown keys are an error; missing keys are the caller's to check
    (a plain HF checkpoint has no Engram parameters). A tied model ignores lm_head.weight."""
    out: dict[str, torch.Tensor] = {}
    for name, value in hf_sd.items():
        if name.startswith(ENGRAM_PREFIX):
            out[name[len(ENGRAM_PREFIX) :]] = value
            continue
        if _HF_IGNORED.search(name) or name == HASH_LOOKUP:
            continue
        engram = _HF_ENGRAM.match(name)
        if engram is not None:
            out[engram.group(1)] = value
            continue
        if name in _TOP_INV:
            if name == "lm_head.weight" and args.tie_embeddings:
                continue
            out[_TOP_INV[name]] = value
            continue
        m = _HF_LAYER.match(name)
        if m is None or m.group(2) not in _LAYER_INV:
            raise KeyError(
                f"unknown Hugging Face parameter {name!r}: not a Llama/Qwen2/Qwen3 dense-model "
                "weight this adapter maps"
            )
        layer, module, kind = m.groups()
        if int(layer) >= args.n_layers:
            raise KeyError(
                f"{name!r} is layer {layer}, but the model has {args.n_layers} layers: "
                "pick the flavor that matches the checkpoint"
            )
        out[f"layers.{layer}.{_LAYER_INV[module]}.{kind}"] = value
    return out
