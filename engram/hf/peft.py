"""PEFT adapter export (training.mode = "lora"): a folder that Hugging Face PEFT loads onto the
transformers base model (`PeftModel.from_pretrained(base, folder)`), plus the Engram weights.

    adapter_config.json        peft_type LORA, r, lora_alpha, lora_dropout, target_modules (HF
                               projection names), task_type CAUSAL_LM, base_model_name_or_path
    adapter_model.safetensors  base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight
                               [r, in] and ...lora_B.weight [out, r]: PEFT's key names; the tensors
                               are stored unscaled (PEFT multiplies by lora_alpha / r, as we do)
    engram.safetensors         the Engram weights with their config header (engram/hf/export.py)

The merged alternative (adapters folded into the base weights, an ordinary HF folder) is
`engram.models.lora.merge_lora_` followed by `engram.hf.export.export`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from engram.config import JobConfig
from engram.hf.adapter import hf_module_name
from engram.hf.checksums import CHECKSUMS_FILE, write_checksums
from engram.hf.export import export, full_cpu
from engram.models.lora import LoRAMixin
from engram.models.transformer import clean_fqn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def peft_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT key -> full adapter tensor (DTensors are gathered: collective then)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRAMixin):
            key = PEFT_PREFIX + hf_module_name(clean_fqn(name))
            out[f"{key}.lora_A.weight"] = full_cpu(module.lora_A)
            out[f"{key}.lora_B.weight"] = full_cpu(module.lora_B)
    if not out:
        raise ValueError("the model has no LoRA adapters: train with training.mode = 'lora'")
    return out


def adapter_config(cfg: JobConfig) -> dict[str, Any]:
    """adapter_config.json: the fields PEFT's LoraConfig reads (the rest take PEFT's defaults)."""
    lora = cfg.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.model.hf_checkpoint or None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def export_peft(
    model: nn.Module,
    cfg: JobConfig,
    engram_config: dict[str, Any],
    fingerprint: dict[str, Any],
    out: str | Path,
) -> list[Path]:
    """Write the PEFT adapter folder (+ engram.safetensors when the model has Engram) to `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = peft_state_dict(model)
    save_file(weights, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg), indent=2) + "\n")
    written = [out / ADAPTER_CONFIG, out / ADAPTER_WEIGHTS]
    if any(".engram." in f".{n}" for n, _ in model.named_parameters()):
        written += export(model, cfg.model.name, engram_config, fingerprint, out, engram_only=True)
    written = [p for p in written if p.name != CHECKSUMS_FILE]
    return written + [write_checksums(out, written)]
