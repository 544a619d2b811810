"""LoRA export: a lora run (FSDP2, 2 ranks, backbone from an HF folder) exported by
scripts/export_hf.py as a PEFT adapter folder and as a merged HF folder.

- HF PEFT (`PeftModel.from_pretrained`) on the transformers base model gives the trained model's
  logits with Engram disabled (its value projection zeroed: the block then adds exactly 0); the
  merged folder in transformers (trust_remote_code: Engram in its modeling file) gives them with
  Engram on;
- the merged folder loaded back by our recipe path (its engram.safetensors included) gives the
  trained model's logits with Engram on.

transformers / peft run only in forked children (tests/test_hf_transformers.py says why).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess

import numpy as np
import pytest
import torch
from launcher import run_distributed, run_isolated
from safetensors import safe_open
from test_hf_checkpoint_export import _batch, _export

from engram.config import config_from_dict, to_toml

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None,
    reason="peft / transformers are not installed: pip install -e '.[dev]'",
)


def _raw(folder: str, base: str) -> dict:
    return {
        "job": {"dump_folder": folder, "run_name": "lora", "device": "cpu", "seed": 4},
        "model": {"flavor": "debug", "hf_checkpoint": base},
        "engram": {
            "layer_ids": [1],
            "n_head_per_ngram": 2,
            "vocab_size_per_ngram": [1009, 997],
            "n_embed_per_ngram": 32,
        },
        "training": {"mode": "lora", "seq_len": 16, "local_batch_size": 2, "steps": 3},
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "data": {"synthetic_num_entities": 32},
        "optimizer": {"lr": 1e-2},
        "lr_scheduler": {"warmup_steps": 0},
        "parallelism": {"dp_shard": 2},
        "checkpoint": {"enable": True, "interval": 3},
        "metrics": {"enable_tensorboard": False},
    }


def _base_folder(raw: dict, out: str) -> None:
    """The pretrained backbone: the debug model's init with seed 9, as an HF folder."""
    from engram.data.tokenizer import load_tokenizer
    from engram.hf.export import export
    from engram.models.builder import build_from_config

    plain = {"job": raw["job"], "engram": {"enabled": False}, "model": {"flavor": "debug"}}
    model, _ = build_from_config(config_from_dict(plain), load_tokenizer(""))
    model.to_empty(device="cpu")
    model.init_weights(seed=9)
    export(model, "llama3", {}, {}, out, tokenizer=load_tokenizer(""))


def _train(rank: int, world: int, raw: dict) -> None:
    from recipes.train import train

    train(config_from_dict(raw))


def _ours(raw: dict) -> dict:
    """The trained model (from its checkpoint): logits with Engram on and off."""
    from engram.inference import build_for_generation, load_weights

    cfg = config_from_dict(raw)
    model, _, hasher = build_for_generation(cfg, 16)
    load_weights(model, cfg, source="checkpoint", checkpoint_step=3)
    ids, hash_ids = _batch(hasher)
    with torch.no_grad():
        on = model(ids, hash_ids=hash_ids)
        for block in model.engram_blocks().values():
            block.value_proj.weight.zero_()
        off = model(ids, hash_ids=hash_ids)
    return {"on": on.numpy(), "off": off.numpy(), "ids": ids.numpy()}


def _transformers(base: str, peft_dir: str, merged: str, ids: np.ndarray) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    x = torch.from_numpy(ids)
    out = {}
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        out["base"] = model(x).logits.numpy()
        out["peft"] = PeftModel.from_pretrained(model, peft_dir)(input_ids=x).logits.numpy()
        merged_model = AutoModelForCausalLM.from_pretrained(
            merged, dtype=torch.float32, trust_remote_code=True
        )
        out["merged"] = merged_model(x).logits.numpy()
    return out


def _ours_from_merged(raw: dict, merged: str) -> np.ndarray:
    from engram.inference import build_for_generation, load_weights

    full = {**raw, "training": {**raw["training"], "mode": "full"}}
    full.pop("lora")
    full["model"] = {**raw["model"], "hf_checkpoint": merged}
    full["job"] = {**raw["job"], "run_name": "none"}  # no checkpoint there: the HF folder loads
    cfg = config_from_dict(full)
    model, _, hasher = build_for_generation(cfg, 16)
    load_weights(model, cfg, source="hf")
    ids, hash_ids = _batch(hasher)
    with torch.no_grad():
        return model(ids, hash_ids=hash_ids).numpy()


@pytest.mark.slow
def test_peft_and_merged_exports_reproduce_the_trained_model(tmp_path):
    base = str(tmp_path / "base")
    raw = _raw(str(tmp_path), base)
    run_isolated(_base_folder, raw, base)
    run_distributed(_train, 2, raw)
    toml = tmp_path / "lora.toml"
    toml.write_text(to_toml(config_from_dict(raw)))

    peft_dir, merged = tmp_path / "peft", tmp_path / "merged"
    files = run_isolated(_export, ["--out", str(peft_dir), f"--job.config_file={toml}"])
    names = sorted(p.rsplit("/", 1)[-1] for p in files)
    assert names == [
        "adapter_config.json", "adapter_model.safetensors", "checksums.sha256", "engram.safetensors"
    ]  # fmt: skip
    listed = (peft_dir / "checksums.sha256").read_text().splitlines()
    assert sorted(line.split("  ")[1] for line in listed) == [n for n in names if "sha256" not in n]
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", "-c", "checksums.sha256"], cwd=peft_dir, check=True)
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    with safe_open(str(peft_dir / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        shape = f.get_slice("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight")
        assert shape.get_shape() == [4, 768]
    assert len(keys) == 4 * 3 * 2
    assert "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight" in keys
    run_isolated(_export, ["--out", str(merged), "--merged", f"--job.config_file={toml}"])

    ours = run_isolated(_ours, raw)
    hf = run_isolated(_transformers, base, str(peft_dir), str(merged), ours["ids"])
    assert np.abs(hf["base"] - ours["off"]).max() > 1e-3, "the adapters changed nothing"
    np.testing.assert_allclose(hf["peft"], ours["off"], rtol=1e-5, atol=2e-5)
    # The merged folder is self-contained (Engram in its modeling file): Engram on.
    np.testing.assert_allclose(hf["merged"], ours["on"], rtol=1e-5, atol=2e-5)
    assert np.abs(ours["on"] - ours["off"]).max() > 1e-4, "Engram contributed nothing"
    back = run_isolated(_ours_from_merged, raw, str(merged))
    np.testing.assert_allclose(back, ours["on"], rtol=1e-5, atol=2e-5)


def _losses(rank: int, world: int, raw: dict) -> dict:
    from recipes.train import train

    result = train(config_from_dict(raw))
    return {"losses": result.losses, "start": result.start_step}


@pytest.mark.slow
def test_trainable_only_checkpoint_resumes_exactly_on_the_hf_folder(tmp_path):
    """checkpoint.trainable_only saves adapters, Engram and their optimizer state only; a resume
    from it on the same HF folder replays the uninterrupted run's losses exactly, and the export
    reads it on top of that folder."""
    import torch.distributed.checkpoint as dcp

    base = str(tmp_path / "base")
    raw = _raw(str(tmp_path), base)
    raw["training"]["steps"] = 4
    raw["checkpoint"] = {"enable": True, "interval": 2, "keep_latest_k": 0, "trainable_only": True}
    run_isolated(_base_folder, raw, base)
    full = run_distributed(_losses, 2, raw)[0]
    folder = tmp_path / "lora" / "checkpoint"
    meta = dcp.FileSystemReader(str(folder / "step-2")).read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(
        k.endswith(("lora_A", "lora_B")) or ".engram." in k for k in model_keys
    ), model_keys
    assert any(k.startswith("optimizer.") for k in meta.state_dict_metadata)
    shutil.rmtree(folder / "step-4")
    resumed = run_distributed(_losses, 2, raw)[0]
    assert resumed["start"] == 2
    assert resumed["losses"] == full["losses"][2:]
    toml = tmp_path / "t.toml"
    toml.write_text(to_toml(config_from_dict(raw)))
    files = run_isolated(_export, ["--out", str(tmp_path / "peft"), f"--job.config_file={toml}"])
    assert any(f.endswith("adapter_model.safetensors") for f in files)
