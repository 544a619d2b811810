"""Safetensors export round trip: a checkpoint saved at world 2 (FSDP), exported by
scripts/export_hf.py (the self-contained transformers folder), imported at world 3 (FSDP,
row-sharded tables) through the HF loader gives the same logits as the checkpoint itself; the Engram-only file reads back and refuses another
hashing config."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from launcher import run_distributed, run_isolated
from safetensors import safe_open
from small_job import small_job

from engram.checkpoint import CheckpointError
from engram.config import config_from_dict, to_toml
from engram.hf.export import EngramExportError, load_engram_safetensors

ROOT = Path(__file__).resolve().parents[1]


def _raw(folder: str) -> dict:
    extra = {
        "job": {"seed": 4},
        "engram": {"layer_ids": [1, 2]},
        "training": {"seq_len": 16, "local_batch_size": 2},
        "data": {"synthetic_num_entities": 32},
        "optimizer": {"lr": 1e-2},
        "lr_scheduler": {"warmup_steps": 10},
        "checkpoint": {"enable": True, "interval": 2},
        "metrics": {"log_freq": 1},
    }
    return small_job(folder, "export", 2, 2, extra)


def _train(rank: int, world: int, raw: dict) -> None:
    from recipes.train import train

    train(config_from_dict(raw))


def _export(argv: list[str]) -> list[str]:
    spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [str(p) for p in module.main(argv)]


def _batch(hasher) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    return ids, torch.from_numpy(hasher(ids.numpy()))


def _reference(raw: dict) -> dict:
    from engram.checkpoint import find_checkpoint, load_model_checkpoint
    from engram.checkpoint.fingerprint import config_fingerprint
    from engram.data.tokenizer import load_tokenizer
    from engram.models.builder import build_for_inference

    cfg = config_from_dict(raw)
    tok = load_tokenizer("")
    model, hasher = build_for_inference(cfg, tok, 16)
    path = find_checkpoint(cfg.run_folder / cfg.checkpoint.folder, 2)
    load_model_checkpoint(model, path, config_fingerprint(cfg, tok, hasher))
    ids, hash_ids = _batch(hasher)
    with torch.no_grad():
        logits = model(ids, hash_ids=hash_ids)
    engram = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if ".engram." in n}
    return {"logits": logits.numpy(), "engram": engram}


def _import(rank: int, world: int, raw: dict, folder: str) -> np.ndarray:
    from engram.data.tokenizer import load_tokenizer
    from engram.hf.load import load_hf_backbone
    from engram.models.builder import build_from_config
    from parallelisms.parallel_dims import parallel_dims_from_config
    from parallelisms.parallelize import parallelize_model

    cfg = config_from_dict(raw)
    dims = parallel_dims_from_config(cfg, world)
    dims.build_mesh("cpu")
    tok = load_tokenizer("")
    model, hasher = build_from_config(cfg, tok)
    parallelize_model(model, cfg, dims)
    model.to_empty(device="cpu")
    model.init_weights(seed=99)  # another init: the import must overwrite every tensor
    load_hf_backbone(model, folder, model.args)
    ids, hash_ids = _batch(hasher)
    with torch.no_grad():
        return model(ids, hash_ids=hash_ids).numpy()


def _engram_only(raw: dict, file: str, other_seed: bool) -> int:
    from engram.checkpoint.fingerprint import config_fingerprint
    from engram.data.tokenizer import load_tokenizer
    from engram.models.builder import build_for_inference

    if other_seed:
        raw = {**raw, "engram": {**raw["engram"], "seed": 5}}
    cfg = config_from_dict(raw)
    tok = load_tokenizer("")
    model, hasher = build_for_inference(cfg, tok, 16)
    n = load_engram_safetensors(model, file, config_fingerprint(cfg, tok, hasher))
    return {
        "n": n,
        **{k: p.detach().numpy().copy() for k, p in model.named_parameters() if ".engram." in k},
    }


@pytest.mark.slow
def test_export_at_one_layout_import_at_another(tmp_path):
    raw = _raw(str(tmp_path))
    run_distributed(_train, 2, raw)
    toml = tmp_path / "export.toml"
    toml.write_text(to_toml(config_from_dict(raw)))
    out = tmp_path / "hf"
    files = run_isolated(_export, ["--out", str(out), f"--job.config_file={toml}"])
    assert {Path(f).name for f in files} == {
        "model.safetensors",
        "config.json",
        "modeling_engram.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "checksums.sha256",
    }
    config = json.loads((out / "config.json").read_text())
    assert (
        config["architectures"] == ["EngramLlamaForCausalLM"] and config["num_hidden_layers"] == 4
    )
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.embed_tokens.weight", "model.layers.1.engram.table.weight"} <= keys
    assert "engram_hash.lookup" in keys
    assert config["engram"]["layer_ids"] == [1, 2]
    assert config["engram"]["table_primes"]["1"] == [1009, 1013, 997, 1019]
    assert config["engram_titan"]["fingerprint"]["engram"]["table_primes"]["1"] == [
        1009,
        1013,
        997,
        1019,
    ]
    assert "[engram]" in config["engram_titan"]["training_config"]

    ref = run_isolated(_reference, raw)
    imported = run_distributed(_import, 3, {**raw, "parallelism": {"dp_shard": 3}}, str(out))
    for logits in imported:
        np.testing.assert_allclose(logits, ref["logits"], rtol=1e-5, atol=1e-5)

    # (b) Engram-only weights.
    only = tmp_path / "only"
    run_isolated(_export, ["--out", str(only), "--engram-only", f"--job.config_file={toml}"])
    assert sorted(p.name for p in only.iterdir()) == ["checksums.sha256", "engram.safetensors"]
    got = run_isolated(_engram_only, raw, str(only / "engram.safetensors"), False)
    assert got.pop("n") == len(ref["engram"])
    for name, value in ref["engram"].items():
        assert np.array_equal(got[name], value), name
    with pytest.raises(EngramExportError, match="engram.hash_seed"):
        run_isolated(_engram_only, raw, str(only / "engram.safetensors"), True)

    # A step that does not exist is named with the steps that do (not called damaged).
    with pytest.raises(CheckpointError, match=r"has no step-3; its checkpoints: steps \[2\]"):
        run_isolated(
            _export, ["--out", str(tmp_path / "x"), "--step", "3", f"--job.config_file={toml}"]
        )
    # A used folder (here: an earlier sharded export's index and shards) is refused, and
    # --overwrite removes the stale files, so the importer reads the new export.
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"old")
    (stale / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}})
    )
    (stale / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_isolated(_export, ["--out", str(stale), f"--job.config_file={toml}"])
    run_isolated(_export, ["--out", str(stale), "--overwrite", f"--job.config_file={toml}"])
    assert sorted(p.name for p in stale.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "modeling_engram.py",
         "notes.txt", "tokenizer.json", "tokenizer_config.json", "checksums.sha256"]
    )  # fmt: skip
    # The run's folder (or one inside it) is refused even with --overwrite, before any file of
    # the run is touched.
    run = tmp_path / "export"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert "config.toml" in before
    for out in (run, run / "hf", run / "checkpoint"):
        with pytest.raises(FileExistsError, match="training run's folder"):
            run_isolated(_export, ["--out", str(out), "--overwrite", f"--job.config_file={toml}"])
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert not (run / "hf").exists()
