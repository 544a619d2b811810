"""What a LoRA checkpoint must agree on to be resumed or exported.

One lora run (1 rank, checkpoint.trainable_only, backbone from an HF folder) saves step 2; then
the real recipe resumes it, in one forked rank per test:

- another base folder (other weights), or no model.hf_checkpoint (random backbone), is refused
  naming the recorded and the given base; a copy of the base at another path resumes;
- another lora.rank, lora.alpha or fewer lora.target_modules is refused naming the key with both
  values; another lora.dropout resumes (not part of what the weights mean);
- scripts/export_hf.py refuses a command-line lora.alpha / lora.dropout that differs from the
  run's, and writes adapter_config.json with the run's values.

Plus unit checks: the base identity is content, not path; a full run's fingerprint keeps its
keys (its old checkpoints still resume) and a fingerprint without the new keys is accepted.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil

import pytest
from launcher import run_distributed, run_isolated
from test_hf_checkpoint_export import _export
from test_hf_peft_export import _raw as _peft_raw

from engram.checkpoint import CheckpointError, fingerprint_mismatches
from engram.checkpoint.fingerprint import config_fingerprint
from engram.config import config_from_dict, to_toml
from engram.data.tokenizer import load_tokenizer
from engram.models.builder import build_hasher


def _raw(folder, base: str) -> dict:
    raw = _peft_raw(str(folder), base)
    raw["parallelism"] = {}
    raw["training"]["steps"] = 2
    raw["checkpoint"] = {"enable": True, "interval": 2, "trainable_only": True}
    return raw


def _with(raw: dict, name: str, **changes: dict) -> dict:
    """`raw` with `changes`, resuming a copy of its run folder (attempts change run folders)."""
    from pathlib import Path

    out = copy.deepcopy(raw)
    for section, values in changes.items():
        out[section] = {**out.get(section, {}), **values}
    run = Path(raw["job"]["dump_folder"]) / raw["job"]["run_name"]
    dump = Path(raw["job"]["dump_folder"]) / "attempts" / name
    shutil.copytree(run, dump / raw["job"]["run_name"])
    out["job"]["dump_folder"] = str(dump)
    out["training"]["steps"] = 3  # resume and take one step
    return out


def _base_folder(out: str, seed: int = 9) -> None:
    """A pretrained backbone: the debug model's init with `seed`, as an HF folder."""
    from engram.hf.export import export
    from engram.models.builder import build_from_config

    plain = {"engram": {"enabled": False}, "model": {"flavor": "debug"}}
    model, _ = build_from_config(config_from_dict(plain), load_tokenizer(""))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    export(model, "llama3", {}, {}, out, tokenizer=load_tokenizer(""))


def _attempts(rank: int, world: int, runs: dict[str, dict]) -> dict[str, object]:
    """Each config's resume: its start step, or the error it was refused with."""
    from recipes.train import train

    out: dict[str, object] = {}
    for name, raw in runs.items():
        try:
            out[name] = train(config_from_dict(raw)).start_step
        except CheckpointError as e:
            out[name] = str(e)
    return out


def _save(rank: int, world: int, raw: dict) -> None:
    from recipes.train import train

    train(config_from_dict(raw))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(raw config of a trainable_only lora run with step-2 saved, base, other base, copy)."""
    tmp = tmp_path_factory.mktemp("lora_resume")
    base, other, moved = str(tmp / "base"), str(tmp / "other"), str(tmp / "moved" / "base")
    raw = _raw(tmp, base)
    run_isolated(_base_folder, base)
    run_isolated(_base_folder, other, seed=10)
    shutil.copytree(base, moved)
    run_distributed(_save, 1, raw)
    return raw, base, other, moved


@pytest.mark.slow
def test_trainable_only_resume_refuses_another_or_no_base(lora_run):
    raw, base, other, moved = lora_run
    out = run_distributed(
        _attempts,
        1,
        {
            "other": _with(raw, "other", model={"hf_checkpoint": other}),
            "none": _with(raw, "none", model={"hf_checkpoint": ""}),
            "moved": _with(raw, "moved", model={"hf_checkpoint": moved}),
        },
    )[0]
    assert out["moved"] == 2, out["moved"]  # the same files at another path: the same base
    for name, given in (("other", f"model.hf_checkpoint {other}"), ("none", "job.seed 4")):
        message = out[name]
        assert isinstance(message, str), f"{name}: resumed at step {message} on another backbone"
        assert "frozen_base" in message and f"model.hf_checkpoint {base}" in message, message
        assert given in message and "Fix: set model.hf_checkpoint to that base" in message


@pytest.mark.slow
def test_lora_settings_are_refused_by_name(lora_run):
    raw, *_ = lora_run
    out = run_distributed(
        _attempts,
        1,
        {
            "rank": _with(raw, "rank", lora={"rank": 8}),
            "alpha": _with(raw, "alpha", lora={"alpha": 16.0}),
            "targets": _with(raw, "targets", lora={"target_modules": ["q_proj", "v_proj"]}),
            "dropout": _with(raw, "dropout", lora={"dropout": 0.1}),
        },
    )[0]
    expected = {
        "rank": "lora.rank: checkpoint 4, this run 8",
        "alpha": "lora.alpha: checkpoint 8.0, this run 16.0",
        "targets": 'lora.target_modules: checkpoint ["down_proj", "q_proj", "v_proj"], this run '
        '["q_proj", "v_proj"]',
    }
    for name, line in expected.items():
        assert isinstance(out[name], str), f"lora.{name} changed but the run resumed"
        assert line in out[name], out[name]
    assert out["dropout"] == 2, out["dropout"]  # training-time noise: the weights mean the same


@pytest.mark.slow
def test_peft_export_takes_the_runs_lora_settings(lora_run, tmp_path):
    raw, *_ = lora_run
    toml = tmp_path / "run.toml"
    toml.write_text(to_toml(config_from_dict(raw)))
    argv = ["--out", str(tmp_path / "peft"), f"--job.config_file={toml}"]
    with pytest.raises(CheckpointError, match=r"lora\.alpha: checkpoint 8\.0, this run 16\.0"):
        run_isolated(_export, [*argv, "--lora.alpha=16"])
    with pytest.raises(Exception, match=r"lora\.dropout: the checkpoint's run 0\.0, this command"):
        run_isolated(_export, [*argv, "--lora.dropout=0.2"])
    run_isolated(_export, argv)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    got = [config[k] for k in ("r", "lora_alpha", "lora_dropout", "target_modules")]
    assert got == [4, 8.0, 0.0, ["down_proj", "q_proj", "v_proj"]]


# ----------------------------------------------------------------------------- unit checks


def test_base_identity_is_content_not_path(tmp_path):
    from engram.checkpoint.base_identity import base_identity

    run_isolated(_base_folder, str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a, b = base_identity(tmp_path / "a"), base_identity(tmp_path / "b")
    assert a["folder"] != b["folder"] and not fingerprint_mismatches(
        {"frozen_base": a}, {"frozen_base": b}
    )
    file = tmp_path / "b" / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor: in the sampled end window
    file.write_bytes(bytes(data))
    lines = fingerprint_mismatches(
        {"frozen_base": a}, {"frozen_base": base_identity(tmp_path / "b")}
    )
    assert len(lines) == 1 and str(tmp_path / "a") in lines[0] and str(tmp_path / "b") in lines[0]


def _fingerprint(raw: dict) -> dict:
    cfg = config_from_dict(raw)
    tokenizer = load_tokenizer("")
    return config_fingerprint(cfg, tokenizer, build_hasher(cfg, tokenizer))


def test_full_fingerprint_unchanged_and_older_checkpoints_accepted(tmp_path, caplog):
    raw = _raw(tmp_path, "")
    full = {k: v for k, v in raw.items() if k not in ("lora", "checkpoint")}
    full["training"] = {**raw["training"], "mode": "full"}
    # The keys of an older full run's fingerprint: its checkpoints still resume.
    assert set(_fingerprint(full)) == {
        "engram", "engram_head_dim", "engram_layers", "engram_table_rows", "model",
        "model_shape", "tokenizer", "training_mode", "table_optimizer", "vocab_size",
    }  # fmt: skip
    lora = _fingerprint(raw)
    assert lora["lora"] == {"rank": 4, "alpha": 8.0, "target_modules": sorted(
        raw["lora"]["target_modules"])}  # fmt: skip
    assert lora["frozen_base"] == {"init_seed": 4}
    older = {k: v for k, v in lora.items() if k not in ("lora", "frozen_base")}
    log = logging.getLogger("engram")  # it may not propagate (engram.runtime.logs.init_logging)
    log.addHandler(caplog.handler)
    try:
        assert fingerprint_mismatches(older, lora) == []
    finally:
        log.removeHandler(caplog.handler)
    assert "does not record which frozen backbone" in caplog.text
    assert "lora.rank / lora.alpha / lora.target_modules" in caplog.text
