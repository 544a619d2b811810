"""What an exported folder guarantees to whoever reads it.

- checksums.sha256 (`sha256sum -c` format) covers every file; our readers (the re-import that
  generation / evaluation use, the Engram-only reader) refuse a changed, missing or added file
  by name, and read a folder without the file with a warning;
- multipliers and primes are derived from config.json's seed and sizes on load (ours and the
  remote modeling file's torch-free transcription, equal for many seeds / layers / sizes); a
  config whose stored values disagree is refused naming the key, in our re-import and in
  transformers;
- transformers reads the tokenizer (AutoTokenizer with trust_remote_code, or
  PreTrainedTokenizerFast without) and the model (trust_remote_code) without a prompt or a type
  warning (stdin closed, logs captured); without the flag it refuses the model, naming the flag,
  instead of building the plain backbone (config.json's model_type is engram_qwen3);
- `tokenizer(prompt)` starts a prompt as training did, so transformers' greedy `generate` with
  its defaults gives recipes/generate.py's default output, token for token;
- the export refuses a run's folder (or one inside it, or one holding the checkpoint).

transformers runs only in forked children (see tests/test_hf_transformers.py).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from launcher import run_isolated

from engram.checkpoint.fingerprint import config_fingerprint
from engram.config import config_from_dict, to_toml
from engram.hashing.ngram import find_table_primes, layer_multipliers
from engram.hf.checksums import CHECKSUMS_FILE, ChecksumError, write_checksums
from engram.hf.export import check_not_run_folder, export, load_engram_safetensors
from engram.hf.load import HFLoadError, load_hf_backbone
from engram.inference import build_for_generation, encode_prompt, generate, load_weights

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed: pip install -e '.[dev]' for the export tests",
)

ROOT = Path(__file__).resolve().parents[1]
MODELING = ROOT / "engram" / "hf" / "remote" / "modeling_engram.py"
PROMPT, NEW = "The capital of Zorbia is", 12
RAW = {
    "job": {"device": "cpu", "seed": 3},
    "model": {"name": "qwen3", "flavor": "debug"},
    "engram": {
        "layer_ids": [1], "n_head_per_ngram": 2, "vocab_size_per_ngram": [1009, 997],
        "n_embed_per_ngram": 32, "init": "paper",
    },
}  # fmt: skip


def _cfg(**engram):
    return config_from_dict({**RAW, "engram": {**RAW["engram"], **engram}})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The init model of RAW (what recipes/generate.py --source init runs), exported."""
    root = tmp_path_factory.mktemp("integrity")
    cfg = _cfg()
    model, tok, hasher = build_for_generation(cfg, 64)
    fp = config_fingerprint(cfg, tok, hasher)
    export(
        model, "qwen3", {}, fp, root / "hf", tokenizer=tok, hasher=hasher, config_toml=to_toml(cfg)
    )
    export(model, "qwen3", {}, fp, root / "only", engram_only=True)
    return root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # in the tensor data, so the file still parses
    path.write_bytes(bytes(data))


def _import(folder: Path, **engram) -> None:
    model, _, _ = build_for_generation(_cfg(**engram), 16)
    load_hf_backbone(model, folder, model.args)


def _sha256sum_check(folder: Path) -> int | None:
    if shutil.which("sha256sum") is None:
        return None
    return subprocess.run(
        ["sha256sum", "-c", "--quiet", CHECKSUMS_FILE], cwd=folder, capture_output=True
    ).returncode


# ----------------------------------------------------------------------------- 4: checksums


def test_checksums_cover_every_file_and_changed_files_are_refused(exported, tmp_path, caplog):
    folder = exported / "hf"
    listed = [line.split("  ", 1)[1] for line in (folder / CHECKSUMS_FILE).read_text().splitlines()]
    assert sorted(listed) == sorted(p.name for p in folder.iterdir() if p.name != CHECKSUMS_FILE)
    assert _sha256sum_check(folder) in (0, None)  # the real binary accepts a fresh export
    _import(folder)

    bad = _copy(folder, tmp_path / "flipped")
    _flip_last_byte(bad / "model.safetensors")
    assert _sha256sum_check(bad) in (1, None)
    with pytest.raises(ChecksumError, match=r"model\.safetensors: changed since export"):
        _import(bad)
    # Generation and evaluation read model.hf_checkpoint through the same loader.
    cfg = config_from_dict({**RAW, "model": {**RAW["model"], "hf_checkpoint": str(bad)}})
    model, _, _ = build_for_generation(cfg, 16)
    with pytest.raises(ChecksumError, match=r"model\.safetensors"):
        load_weights(model, cfg, source="hf")

    added = _copy(folder, tmp_path / "added")
    shutil.copyfile(added / "model.safetensors", added / "model-extra.safetensors")
    with pytest.raises(ChecksumError, match=r"model-extra\.safetensors: not listed"):
        _import(added)

    other = _copy(folder, tmp_path / "other_tool")  # a download: no checksums, a warning
    (other / CHECKSUMS_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="engram"):
        _import(other)
    assert f"has no {CHECKSUMS_FILE}" in caplog.text

    only = _copy(exported / "only", tmp_path / "only")
    assert sorted(p.name for p in only.iterdir()) == [CHECKSUMS_FILE, "engram.safetensors"]
    _flip_last_byte(only / "engram.safetensors")
    model, _, _ = build_for_generation(_cfg(), 16)
    with pytest.raises(ChecksumError, match=r"engram\.safetensors: changed"):
        load_engram_safetensors(model, only / "engram.safetensors")


def test_model_type_is_engram_and_older_exports_still_import(exported, tmp_path):
    """An Engram folder names its own model_type (transformers then asks for trust_remote_code
    rather than building the plain backbone); our readers import it and an older export that
    kept the backbone's model_type."""
    config = json.loads((exported / "hf" / "config.json").read_text())
    assert config["model_type"] == "engram_qwen3"
    assert config["auto_map"] == {
        "AutoConfig": "modeling_engram.EngramQwen3Config",
        "AutoModelForCausalLM": "modeling_engram.EngramQwen3ForCausalLM",
    }
    _import(exported / "hf")
    old = _copy(exported / "hf", tmp_path / "old")
    del config["auto_map"]["AutoConfig"]
    (old / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}, indent=2))
    write_checksums(old, [p for p in old.iterdir()])
    _import(old)


# ----------------------------------------------------------------------------- 5: hashing values


def _remote_derivations(cases: list[tuple]) -> list[tuple]:
    """In a forked child (the modeling file imports transformers)."""
    spec = importlib.util.spec_from_file_location("modeling_engram", MODELING)
    remote = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(remote)
    out = []
    for seed, layers, max_ngram, heads, sizes, vocab in cases:
        mult = [remote.layer_multipliers(seed, i, max_ngram, vocab) for i in layers]
        out.append((mult, remote.table_primes(sizes, layers, max_ngram, heads)))
    return out


def test_remote_file_derives_our_multipliers_and_primes():
    cases = [
        (0, [0], 2, 1, [5], 2),
        (1, [1, 15], 3, 8, [646400, 646400], 129280),  # the paper's sizes, Llama-3 vocabulary
        (7, [2, 32], 3, 8, [1009, 997], 151665),  # Qwen2.5's vocabulary
        (2**31 + 5, [3, 17, 61], 4, 2, [1009, 997, 983], 2**31 + 11),  # 32-bit bounded draws
        (10**15, [5], 5, 3, [97, 89, 83, 79], 2**40),
        (12345, [0, 1], 3, 2, [7, 7], 2**62),  # bound 1: every multiplier is 1
    ]
    theirs = run_isolated(_remote_derivations, cases)
    for (seed, layers, max_ngram, heads, sizes, vocab), (mult, primes) in zip(
        cases, theirs, strict=True
    ):
        assert mult == [
            [int(m) for m in layer_multipliers(seed, i, max_ngram, vocab)] for i in layers
        ]
        ours = find_table_primes(sizes, layers, max_ngram, heads)
        assert primes == {str(k): v for k, v in ours.items()}


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config["engram"])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_checksums(folder, [p for p in folder.iterdir()])  # not a checksum refusal


def _transformers_load(folders: list[str]) -> list[str]:
    from transformers import AutoModelForCausalLM

    out = []
    for folder in folders:
        try:
            AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
            out.append("loaded")
        except ValueError as e:
            out.append(str(e))
    return out


def test_edited_hashing_values_are_refused(exported, tmp_path):
    def mult(e):
        e["multipliers"]["1"][0] += 2

    def seed(e):
        e["seed"] += 1

    def prime(e):
        e["table_primes"]["1"][1] = 1019

    def pad(e):
        e["compressed_pad_id"] += 1

    folders = {}
    for name, edit in (("mult", mult), ("seed", seed), ("prime", prime), ("pad", pad)):
        folders[name] = _copy(exported / "hf", tmp_path / name)
        _edit_config(folders[name], edit)
    with pytest.raises(HFLoadError, match=r"engram\.multipliers\['1'\] = \[\d+, .*derive"):
        _import(folders["mult"])
    with pytest.raises(HFLoadError, match=r"engram\.seed = 1 .*\n.*engram\.multipliers\['1'\]"):
        _import(folders["seed"])
    with pytest.raises(HFLoadError, match=r"engram\.table_primes\['1'\]"):
        _import(folders["prime"])
    # An intact folder read by a run that hashes differently is refused too.
    with pytest.raises(HFLoadError, match=r"engram\.seed = 0 in the folder, 5 in this run"):
        _import(exported / "hf", seed=5)
    named = {
        "mult": "engram.multipliers['1']", "seed": "engram.multipliers['1']",
        "prime": "engram.table_primes['1']", "pad": "compressed_pad_id",
    }  # fmt: skip
    msgs = run_isolated(_transformers_load, [str(folders[n]) for n in named], timeout=300)
    for key, msg in zip(named.values(), msgs, strict=True):
        assert key in msg, msg


# ----------------------------------------------------------------------------- 6, 7: transformers


def _transformers_defaults(folder: str) -> dict:
    """The model without trust_remote_code (stdin closed: a prompt reads EOF, a refusal), then
    the tokenizer and the model with it, every message captured; then tokenizer(prompt) +
    greedy generate, all defaults."""
    import contextlib
    import io
    import sys
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    def quiet(load):
        logs, out = io.StringIO(), io.StringIO()
        handler = logging.StreamHandler(logs)
        hf_logging.get_logger().addHandler(handler)
        sys.stdin = io.StringIO("")
        try:
            with (
                warnings.catch_warnings(record=True) as caught,
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(out),
            ):
                warnings.simplefilter("always")
                obj = load()
        finally:
            hf_logging.get_logger().removeHandler(handler)
            sys.stdin = sys.__stdin__
        noise = logs.getvalue() + out.getvalue() + "".join(str(w.message) for w in caught)
        return obj, noise

    try:
        plain = type(quiet(lambda: AutoModelForCausalLM.from_pretrained(folder))[0]).__name__
    except ValueError as e:
        plain = f"refused: {e}"
    tok, tok_noise = quiet(lambda: AutoTokenizer.from_pretrained(folder, trust_remote_code=True))
    fast, fast_noise = quiet(lambda: PreTrainedTokenizerFast.from_pretrained(folder))
    model, model_noise = quiet(
        lambda: AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    )
    enc = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    return {
        "tokenizer_noise": tok_noise + fast_noise,
        "fast_same": fast(PROMPT)["input_ids"] == tok(PROMPT)["input_ids"],
        "model_noise": model_noise,
        "class": type(model).__name__,
        "without_flag": plain,
        "prompt_ids": enc["input_ids"][0].tolist(),
        "new_ids": ids[0, enc["input_ids"].shape[1] :].tolist(),
        "plain": tok(PROMPT, add_special_tokens=False)["input_ids"],
    }


def test_transformers_defaults_equal_generate_defaults(exported, tmp_path, capsys):
    from recipes.generate import GenerateArgs
    from recipes.generate import main as generate_main

    theirs = run_isolated(_transformers_defaults, str(exported / "hf"), timeout=600)
    assert theirs["tokenizer_noise"] == ""  # no [y/N] prompt, no "model of type" warning
    assert theirs["fast_same"]  # PreTrainedTokenizerFast: the same tokenizer, no remote code
    assert "model of type" not in theirs["model_noise"] and "[y/N]" not in theirs["model_noise"]
    assert theirs["class"] == "EngramQwen3ForCausalLM"
    # Never the plain Qwen3ForCausalLM with the Engram weights dropped; the refusal says how.
    assert theirs["without_flag"].startswith("refused: "), theirs["without_flag"]
    assert "trust_remote_code=True" in theirs["without_flag"]

    cfg = _cfg()
    model, tok, hasher = build_for_generation(cfg, 64)
    prompt_ids = encode_prompt(tok, PROMPT, GenerateArgs().prefix)
    assert theirs["prompt_ids"] == prompt_ids  # eos + the prompt, as the packer starts documents
    assert theirs["plain"] == tok.encode(PROMPT)
    ours = generate(model, torch.tensor([prompt_ids]), hasher, NEW, eos_id=tok.eos_id,
                    vocab_size=tok.vocab_size)  # fmt: skip
    assert theirs["new_ids"] == ours[0, len(prompt_ids) :].tolist()
    # recipes/generate.py with its defaults prints the same text.
    toml = tmp_path / "run.toml"
    toml.write_text(to_toml(cfg))
    argv = ["--prompt", PROMPT, "--max_new_tokens", str(NEW), "--source", "init"]
    completion = generate_main([*argv, f"--job.config_file={toml}"])
    assert completion == tok.decode(theirs["new_ids"])


# ----------------------------------------------------------------------------- 8: run folders


def test_export_refuses_a_run_folder(tmp_path):
    run = tmp_path / "outputs" / "debug"
    step = run / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    for marker in ("config.toml", "metrics.jsonl", "checkpoint/step-*"):
        folder = tmp_path / marker.split("/")[0].replace(".", "_")
        if marker == "checkpoint/step-*":
            (folder / "checkpoint" / "step-5").mkdir(parents=True)
        else:
            folder.mkdir()
            (folder / marker).write_text("[job]\ndump_folder = 'x'\n")
        with pytest.raises(FileExistsError, match=re.escape(f"run's folder (it holds {marker}")):
            check_not_run_folder(folder)
    (run / "config.toml").write_text("[job]\nrun_name = 'debug'\n")
    with pytest.raises(FileExistsError, match="is a training run's folder"):
        check_not_run_folder(run, step)
    with pytest.raises(FileExistsError, match=rf"is inside {run}, which is a training run's"):
        check_not_run_folder(run / "hf", step)
    with pytest.raises(FileExistsError, match="contains the checkpoint being exported"):
        check_not_run_folder(tmp_path / "outputs", step)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "config.toml").write_text("[tool.other]\n")  # not a run's config
    check_not_run_folder(tmp_path / "notes", step)
    check_not_run_folder(tmp_path / "exported", step)
