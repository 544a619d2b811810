"""Safetensors export: the way to share weights (a safetensors file holds no code).

(a) a Hugging Face folder: config.json, model.safetensors (the backbone in HF Llama/Qwen names),
    tokenizer.json, and engram.safetensors (the Engram weights, `engram.<our name>`, with the
    Engram config and checkpoint fingerprint as JSON in the safetensors header). It loads back
    into any layout with `engram.hf_load.load_hf_backbone` (it reads the `engram.` tensors too).
(b) engram.safetensors alone (Engram-only weights), read back with `load_engram_safetensors`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from engram.checkpoint import fingerprint_mismatches
from engram.models.args import ModelArgs
from engram.models.engram import is_engram_param
from engram.models.hf_adapter import ENGRAM_PREFIX, to_hf_state_dict
from engram.models.init import local_view
from engram.models.lora import is_lora_param
from engram.models.transformer import clean_fqn

logger = logging.getLogger("engram")

ENGRAM_FILE = "engram.safetensors"
NOTE_FILE = "README.md"
# Files of an HF model folder: what an export writes or another export / download left there.
_MODEL_FILE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    NOTE_FILE,
)
BACKBONE_ONLY_NOTE = """# Engram model exported by engram-titan

`model.safetensors` and `config.json` hold the **backbone only**; the Engram weights are in
`engram.safetensors`, which plain `transformers` does not read. Opened with
`AutoModelForCausalLM.from_pretrained` this folder runs the backbone **without Engram**: not the
model that was trained (other outputs). Load the whole model with engram-titan:
`model.hf_checkpoint = "<this folder>"` (engram/hf_load.py reads engram.safetensors too).
"""
ENGRAM_FORMAT = "engram-safetensors/1"
_ARCH = {
    "llama3": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


class EngramExportError(ValueError):
    """An Engram safetensors file does not fit the model; the message says what differs."""


def hf_config(args: ModelArgs, family: str) -> dict[str, Any]:
    """config.json for the backbone (the keys hf_load checks, plus what HF needs to build it)."""
    arch, model_type = _ARCH[family]
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "intermediate_size": args.ffn_dim,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if args.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(args.rope_scaling)}
    if family == "qwen2":
        config["attention_bias"] = args.qkv_bias
    return config


def full_cpu(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (DTensor) parameter, detached, on the CPU (collective for a DTensor)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().to("cpu").contiguous()


def export(
    model: nn.Module,
    family: str,
    engram_config: dict[str, Any],
    fingerprint: dict[str, Any],
    out: str | Path,
    engram_only: bool = False,
    tokenizer_file: str | Path | None = None,
) -> list[Path]:
    """Write (a) the HF folder or (b) only engram.safetensors into `out`; returns the files.

    `model` must hold full (unsharded) tensors or DTensors (gathered here: collective then)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {name: full_cpu(p) for name, p in model.state_dict().items()}
    adapters = [name for name in sd if is_lora_param(name)]
    if adapters and not engram_only:
        raise ValueError(
            f"the model has LoRA adapters ({adapters[0]}, ...): write them with "
            "engram.export_peft.export_peft, or fold them in first (engram.models.lora.merge_lora_)"
        )
    sd = {name: t for name, t in sd.items() if not is_lora_param(name)}
    hf = to_hf_state_dict(sd, model.args)
    engram = {k: v for k, v in hf.items() if k.startswith(ENGRAM_PREFIX)}
    backbone = {k: v for k, v in hf.items() if not k.startswith(ENGRAM_PREFIX)}
    written = []
    if engram:
        header = {
            "format": ENGRAM_FORMAT,
            "engram_config": json.dumps(engram_config, sort_keys=True),
            "fingerprint": json.dumps(fingerprint, sort_keys=True),
        }
        save_file(engram, str(out / ENGRAM_FILE), metadata=header)
        written.append(out / ENGRAM_FILE)
    if not engram_only:
        save_file(backbone, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(
            json.dumps(hf_config(model.args, family), indent=2, sort_keys=True) + "\n"
        )
        written += [out / "model.safetensors", out / "config.json"]
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, out / "tokenizer.json")
            written.append(out / "tokenizer.json")
        if engram:
            (out / NOTE_FILE).write_text(BACKBONE_ONLY_NOTE)
            written.append(out / NOTE_FILE)
            logger.warning(
                "%s: plain transformers loads the backbone WITHOUT Engram (engram.safetensors is "
                "not read by it): load it with model.hf_checkpoint (see %s there)",
                out,
                NOTE_FILE,
            )
    return written


def prepare_output_folder(out: str | Path, overwrite: bool) -> None:
    """Refuse a non-empty export folder (a new export beside an old one's files mixes two
    models) unless `overwrite`; then remove the model files an export writes or replaces (any
    safetensors, index, config and tokenizer files) and keep, with a warning, anything else."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a folder")
    present = sorted(p.name for p in out.iterdir())
    if not present:
        return
    if not overwrite:
        raise FileExistsError(
            f"--out {out} is not empty ({', '.join(present[:6])}{', ...' if len(present) > 6 else ''}"
            "): an export beside an earlier one's files mixes two models. Choose an empty or "
            "new folder, or pass --overwrite to replace its model files"
        )
    replaced = sorted({p for pat in _MODEL_FILE_PATTERNS for p in out.glob(pat) if p.is_file()})
    for p in replaced:
        p.unlink()
    kept = sorted(set(present) - {p.name for p in replaced})
    logger.warning("--overwrite: removed %s from %s", [p.name for p in replaced], out)
    if kept:
        logger.warning("--overwrite: kept files an export does not write: %s", kept)


def read_engram_header(file: str | Path) -> dict[str, Any]:
    """The Engram config and fingerprint stored in an engram.safetensors header."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
    if meta.get("format") != ENGRAM_FORMAT:
        raise EngramExportError(
            f"{file} is not an Engram safetensors file (header format {meta.get('format')!r}, "
            f"expected {ENGRAM_FORMAT!r}): export it with scripts/export_hf.py"
        )
    return {k: json.loads(meta[k]) for k in ("engram_config", "fingerprint")}


def load_engram_safetensors(
    model: nn.Module, file: str | Path, fingerprint: dict[str, Any] | None = None
) -> int:
    """Copy the Engram weights of `file` into `model`'s (local shards of) Engram parameters, in
    any layout; returns how many tensors were copied. With `fingerprint` (this run's
    engram.fingerprint.config_fingerprint) the Engram-related keys of the file's fingerprint
    must match it (same hashing, tables, widths), else EngramExportError naming them."""
    header = read_engram_header(file)
    if fingerprint is not None:
        keys = [k for k in fingerprint if k.startswith("engram") or k == "tokenizer"]
        diffs = fingerprint_mismatches(
            {k: header["fingerprint"].get(k) for k in keys}, {k: fingerprint[k] for k in keys}
        )
        if diffs:
            raise EngramExportError(
                f"{file} holds Engram weights for another configuration:\n  "
                + "\n  ".join(diffs)
                + "\nFix: use the Engram config in the file's header (read_engram_header)"
            )
    params = {}
    for raw, p in model.named_parameters():
        name = clean_fqn(raw)
        if is_engram_param(name):
            params[name] = p
    with safe_open(str(file), framework="pt", device="cpu") as f:
        stored = {k[len(ENGRAM_PREFIX) :]: k for k in f.keys()}
        missing, extra = sorted(set(params) - set(stored)), sorted(set(stored) - set(params))
        if missing or extra:
            raise EngramExportError(
                f"{file} does not match this model's Engram parameters: missing {missing[:10]}, "
                f"unexpected {extra[:10]}. Fix: set engram.layer_ids and the engram.* widths to "
                "the file's header"
            )
        with torch.no_grad():
            for name, p in params.items():
                shape = tuple(f.get_slice(stored[name]).get_shape())
                if shape != tuple(p.shape):
                    raise EngramExportError(
                        f"{file}: {name} has shape {list(shape)}, the model {list(p.shape)}"
                    )
                local, local_shape, offset = local_view(p)
                if local.numel() == 0:
                    continue
                index = tuple(slice(o, o + s) for o, s in zip(offset, local_shape, strict=True))
                local.copy_(
                    f.get_slice(stored[name])[index] if index else f.get_tensor(stored[name])
                )
    return len(params)
