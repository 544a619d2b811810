"""PEFT adapter export (training.mode = "lora"): a folder that Hugging Face PEFT loads onto the
transformers base model (`PeftModel.from_pretrained(base, folder)`), plus the Engram weights.

    adapter_config.json        peft_type LORA, r, lora_alpha, lora_dropout, target_modules (HF
                               projection names), task_type CAUSAL_LM, base_model_name_or_path;
                               the LoRA values are the checkpoint's own (recorded_lora)
    adapter_model.safetensors  base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight
                               [r, in] and ...lora_B.weight [out, r]: PEFT's key names; the tensors
                               are stored unscaled (PEFT multiplies by lora_alpha / r, as we do)
    engram.safetensors         the Engram weights with their config header (engram/hf/export.py)

The merged alternative (adapters folded into the base weights, an ordinary HF folder) is
`engram.models.lora.merge_lora_` followed by `engram.hf.export.export`.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from engram.checkpoint import read_fingerprint
from engram.config import ConfigError, JobConfig, Lora
from engram.hf.adapter import hf_module_name
from engram.hf.checksums import CHECKSUMS_FILE, write_checksums
from engram.hf.export import export, full_cpu
from engram.models.lora import LoRAMixin
from engram.models.transformer import clean_fqn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

logger = logging.getLogger("engram")

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


def recorded_lora(cfg: JobConfig, step_dir: Path) -> dict[str, Any]:
    """The LoRA settings checkpoint `step_dir` was trained with, which adapter_config.json
    states: rank, alpha and target_modules from its fingerprint, dropout (not in the
    fingerprint: training-time noise only) from the run folder's config.toml (the config the run
    last trained with; this command's value without one). This command's config must agree: a
    differing value is refused by name, never written."""
    ours = {
        "rank": cfg.lora.rank,
        "alpha": cfg.lora.alpha,
        "target_modules": sorted(cfg.lora.target_modules),
        "dropout": cfg.lora.dropout,
    }
    saved = read_fingerprint(step_dir).get("lora")
    if saved is None:
        logger.warning(
            "checkpoint %s does not record its LoRA settings (written before they were): "
            "adapter_config.json takes this command's lora.rank / alpha / target_modules",
            step_dir,
        )
        saved = {k: ours[k] for k in ("rank", "alpha", "target_modules")}
    recorded = {**saved, "dropout": _run_dropout(cfg)}
    diffs = [
        f"lora.{k}: the checkpoint's run {recorded[k]!r}, this command {ours[k]!r}"
        for k in ours
        if recorded[k] != ours[k]
    ]
    if diffs:
        raise ConfigError(
            f"checkpoint {step_dir} was trained with other LoRA settings than this export "
            "command's config:\n  " + "\n  ".join(diffs) + "\nFix: export with the run's "
            f"config (--job.config_file={cfg.run_folder / 'config.toml'}) or these values"
        )
    return recorded


def _run_dropout(cfg: JobConfig) -> float:
    file = cfg.run_folder / "config.toml"
    if not file.is_file():
        return cfg.lora.dropout
    with file.open("rb") as f:
        return float(tomllib.load(f).get("lora", {}).get("dropout", Lora().dropout))


def adapter_config(lora: dict[str, Any], base: str) -> dict[str, Any]:
    """adapter_config.json from `lora` (recorded_lora) and the base folder `base`: the fields
    PEFT's LoraConfig reads (the rest take PEFT's defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base or None,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": sorted(lora["target_modules"]),
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
    step_dir: Path,
    engram_config: dict[str, Any],
    fingerprint: dict[str, Any],
    out: str | Path,
) -> list[Path]:
    """Write the PEFT adapter folder (+ engram.safetensors when the model has Engram) of the
    checkpoint `step_dir` (read into `model`) to `out`."""
    lora = recorded_lora(cfg, step_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = peft_state_dict(model)
    save_file(weights, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(lora, cfg.model.hf_checkpoint)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    written = [out / ADAPTER_CONFIG, out / ADAPTER_WEIGHTS]
    if any(".engram." in f".{n}" for n, _ in model.named_parameters()):
        written += export(model, cfg.model.name, engram_config, fingerprint, out, engram_only=True)
    written = [p for p in written if p.name != CHECKSUMS_FILE]
    return written + [write_checksums(out, written)]
