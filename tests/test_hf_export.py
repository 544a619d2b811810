"""The self-contained transformers export (engram/hf/export.py, engram/hf/remote/modeling_engram.py).

The recipe's model (Engram on, paper init so Engram changes the logits) is exported for Llama-3.1
(llama3 RoPE scaling, 64 padded output rows), Qwen2 (max_ngram 4, kernel 3), Qwen3 and tied Qwen3
shapes. In a forked child, transformers loads each folder with AutoModelForCausalLM /
AutoTokenizer (trust_remote_code) and must give the recipe's logits bit for bit (fp32, x86 CPU),
the same greedy tokens with and without its KV cache as the recipe's cached decoding, the same
tokens for a left-padded row as for that row alone, and beam search equal with and without the
cache. A damaged folder is refused. A checkpoint written at 2 ranks exports the same folder as
the same weights saved at 1 rank.

transformers runs only in forked children (see tests/test_hf_transformers.py).
"""

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
from engram.checkpoint.fingerprint import config_fingerprint
from engram.config import config_from_dict, to_toml
from engram.hf.export import EngramExportError, export
from engram.inference import build_for_generation, generate

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed: pip install -e '.[dev]' for the export tests",
)

ROOT = Path(__file__).resolve().parents[1]
SEQ, PROMPT, NEW = 40, 12, 10
LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 2048 + 64, "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    },
}  # fmt: skip
ENGRAM = {
    "layer_ids": [0, 2], "n_head_per_ngram": 2, "vocab_size_per_ngram": [1009, 997],
    "n_embed_per_ngram": 32, "init": "paper",
}  # fmt: skip
# case -> (model.name, model.flavor, engram overrides)
CASES = {
    "llama3.1": ("llama3", "hf", {}),
    "qwen2": ("qwen2", "debug", {"max_ngram": 4, "kernel_size": 3, "vocab_size_per_ngram": [1009, 997, 983]}),
    "qwen3": ("qwen3", "debug", {"layer_ids": [1]}),
    "qwen3_tied": ("qwen3", "debug_tied", {}),
}  # fmt: skip


def _cfg(root: Path, case: str):
    name, flavor, engram = CASES[case]
    model = {"name": name, "flavor": flavor}
    if flavor == "hf":
        (root / "shape").mkdir(exist_ok=True)
        (root / "shape" / "config.json").write_text(json.dumps(LLAMA31))
        model["hf_checkpoint"] = str(root / "shape")
    raw = {"job": {"device": "cpu", "seed": 3}, "model": model, "engram": {**ENGRAM, **engram}}
    return config_from_dict(raw)


def _ids() -> torch.Tensor:
    return torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _export_case(root: Path, case: str) -> dict:
    cfg = _cfg(root, case)
    model, tok, hasher = build_for_generation(cfg, SEQ + NEW)
    export(
        model, cfg.model.name, {}, config_fingerprint(cfg, tok, hasher), root / case,
        tokenizer=tok, hasher=hasher, config_toml=to_toml(cfg),
    )  # fmt: skip
    ids = _ids()
    with torch.no_grad():
        logits = model(ids, hash_ids=hasher.hash_torch(ids))
    greedy = generate(model, ids[:, :PROMPT], hasher, NEW, vocab_size=tok.vocab_size)
    assert torch.equal(  # the recipe's own cached decoding is the reference
        greedy,
        generate(model, ids[:, :PROMPT], hasher, NEW, vocab_size=tok.vocab_size, use_cache=False),
    )
    return {
        "logits": logits.numpy(),
        "greedy": greedy.numpy(),
        "encoded": tok.encode("The capital of Zorbia"),
        "tied": model.args.tie_embeddings,
    }


def _transformers_side(root: Path) -> dict:
    """In a forked child: load every exported folder with transformers and run it."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    ids = _ids()
    for case in CASES:
        folder = root / case
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        greedy = {
            "max_new_tokens": NEW,
            "min_new_tokens": NEW,
            "do_sample": False,
            "eos_token_id": None,
        }
        with torch.no_grad():
            res = {
                "class": type(model).__name__,
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                "encoded": tok("The capital of Zorbia", add_special_tokens=False)["input_ids"],
                "logits": model(ids, use_cache=False).logits,
                "cached": model.generate(ids[:, :PROMPT], **greedy),
                "uncached": model.generate(ids[:, :PROMPT], use_cache=False, **greedy),
            }
            # Left padding: row 1 starts 5 tokens later, padded with a token that is not the pad id.
            batch = ids[:, :PROMPT].clone()
            batch[1, :5] = 7
            mask = torch.ones_like(batch)
            mask[1, :5] = 0
            res["padded"] = model.generate(batch, attention_mask=mask, **greedy)
            res["alone"] = model.generate(ids[1:, 5:PROMPT], **greedy)
            if case == "qwen2":
                beam = {"num_beams": 3, "max_new_tokens": 6, "do_sample": False}
                res["beam"] = model.generate(ids[:, :PROMPT], **beam)
                res["beam_uncached"] = model.generate(ids[:, :PROMPT], use_cache=False, **beam)
            # Not vacuous: the Engram blocks change the logits.
            for lid in model.config.engram["layer_ids"]:
                model.model.layers[lid].engram.value_proj.weight.zero_()
            res["no_engram"] = model(ids, use_cache=False).logits
        # numpy: torch shares tensors with the parent by file descriptor, gone with this process
        out[case] = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in res.items()}
    # A damaged folder (an Engram tensor missing) is refused, not filled with random weights.
    broken = root / "broken"
    shutil.copytree(root / "qwen3", broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.engram.value_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    try:
        AutoModelForCausalLM.from_pretrained(broken, trust_remote_code=True)
        out["broken"] = "loaded"
    except ValueError as e:
        out["broken"] = str(e)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    ours = {case: _export_case(root, case) for case in CASES}
    return root, ours, run_isolated(_transformers_side, root, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_transformers_logits_equal_the_recipe(exported, case):
    root, ours, theirs = exported
    got, want = theirs[case], ours[case]
    assert got["class"] == json.loads((root / case / "config.json").read_text())["architectures"][0]
    assert got["tied"] == want["tied"] == (case == "qwen3_tied")
    assert got["logits"].shape == want["logits"].shape
    assert np.array_equal(got["logits"], want["logits"])  # bit-identical, fp32 on x86 CPU
    assert not np.allclose(got["no_engram"], want["logits"], atol=1e-3)
    assert got["encoded"] == want["encoded"]


@pytest.mark.parametrize("case", CASES)
def test_transformers_generate_with_cache(exported, case):
    _, ours, theirs = exported
    got = theirs[case]
    assert np.array_equal(got["cached"], got["uncached"])
    assert np.array_equal(got["cached"], ours[case]["greedy"])
    assert np.array_equal(got["padded"][0], got["cached"][0])
    assert np.array_equal(got["padded"][1, 5:], got["alone"][0])
    if case == "qwen2":
        assert np.array_equal(got["beam"], got["beam_uncached"])


def test_export_folder_contents_and_refusals(exported, tmp_path):
    root, _, theirs = exported
    assert "value_proj" in theirs["broken"] and "missing" in theirs["broken"]
    folder = root / "llama3.1"
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_engram.EngramLlamaForCausalLM"
    assert config["engram"]["table_primes"]["0"] == [1009, 1013, 997, 1019]
    assert (
        config["engram_titan"]["version"]
        and "[engram]" in config["engram_titan"]["training_config"]
    )
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(2048, 2048 + 64))  # padded rows
    modeling = (folder / "modeling_engram.py").read_text()
    assert "import engram" not in modeling and "from engram" not in modeling
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.pt"))
    # Non-finite weights are refused.
    cfg = _cfg(tmp_path, "qwen3")
    model, tok, hasher = build_for_generation(cfg, 16)
    with torch.no_grad():
        model.layers["1"].engram.table.weight[3, 0] = float("nan")
    with pytest.raises(EngramExportError, match="non-finite"):
        export(model, "qwen3", {}, {}, tmp_path / "nan", tokenizer=tok, hasher=hasher)
    assert not (tmp_path / "nan").exists()
    # A shape the family's transformers class does not compute is refused.
    with torch.no_grad():
        model.layers["1"].engram.table.weight[3, 0] = 0.0
    model.args = model.args.replace(qk_norm=False)
    with pytest.raises(EngramExportError, match="qk_norm = False has no transformers class"):
        export(model, "qwen3", {}, {}, tmp_path / "shape", tokenizer=tok, hasher=hasher)


# --------------------------------------------------------------------- resharded checkpoints


def _raw(folder: str, run: str, dp_shard: int) -> dict:
    extra = {
        "job": {"seed": 4},
        "engram": {**ENGRAM, "layer_ids": [1, 2]},
        "training": {"seq_len": 16, "local_batch_size": 2},
        "data": {"synthetic_num_entities": 32},
        "optimizer": {"lr": 1e-2},
        "lr_scheduler": {"warmup_steps": 10},
        "checkpoint": {"enable": True, "interval": 2},
        "metrics": {"log_freq": 1},
    }
    return small_job(folder, run, dp_shard, 2, extra, parallelism={"dp_shard": dp_shard})


def _train(rank: int, world: int, raw: dict) -> None:
    from recipes.train import train

    train(config_from_dict(raw))


def _resave_at_one_rank(raw2: dict, raw1: dict) -> None:
    """Load the 2-rank checkpoint into the unsharded model and save it as a 1-rank run would."""
    from engram.checkpoint import (
        CheckpointManager,
        ModelState,
        find_checkpoint,
        load_model_checkpoint,
    )

    cfg2, cfg1 = config_from_dict(raw2), config_from_dict(raw1)
    model, tok, hasher = build_for_generation(cfg2, 16)
    fingerprint = config_fingerprint(cfg2, tok, hasher)
    load_model_checkpoint(
        model, find_checkpoint(cfg2.run_folder / cfg2.checkpoint.folder, 2), fingerprint
    )
    manager = CheckpointManager(
        cfg1.checkpoint, cfg1.run_folder, {"model": ModelState(model)}, fingerprint,
        per_rank=(), save_rng=False,
    )  # fmt: skip
    manager.save(2)


def _export(argv: list[str]) -> list[str]:
    spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [str(p) for p in module.main(argv)]


@pytest.mark.slow
def test_two_rank_checkpoint_exports_the_one_rank_folder(tmp_path):
    raw2, raw1 = _raw(str(tmp_path), "two", 2), _raw(str(tmp_path), "one", 1)
    run_distributed(_train, 2, raw2)
    run_isolated(_resave_at_one_rank, raw2, raw1)
    folders = {}
    for name, raw in (("two", raw2), ("one", raw1)):
        toml = tmp_path / f"{name}.toml"
        toml.write_text(to_toml(config_from_dict(raw)))
        folders[name] = tmp_path / f"hf_{name}"
        run_isolated(_export, ["--out", str(folders[name]), f"--job.config_file={toml}"])
    files = sorted(p.name for p in folders["one"].iterdir())
    assert files == sorted(p.name for p in folders["two"].iterdir())
    for file in files:
        one, two = (folders[n] / file for n in ("one", "two"))
        if file == "checksums.sha256":  # equal but for config.json's line
            lines = [set(folders[n].joinpath(file).read_text().splitlines()) for n in folders]
            assert {ln.split()[1] for ln in lines[0] ^ lines[1]} == {"config.json"}
        elif file == "config.json":  # equal but for the training config each came from
            c1, c2 = json.loads(one.read_text()), json.loads(two.read_text())
            assert "dp_shard = 2" in c2["engram_titan"].pop("training_config")
            assert "dp_shard = 1" in c1["engram_titan"].pop("training_config")
            assert c1 == c2
        else:
            assert one.read_bytes() == two.read_bytes(), file
    with safe_open(str(folders["two"] / "model.safetensors"), "pt") as f:
        trained = f.get_tensor("model.layers.1.engram.table.weight")
    fresh, _, _ = build_for_generation(config_from_dict(raw2), 16)
    assert not torch.equal(trained, fresh.layers["1"].engram.table.weight.detach())

    # A damaged checkpoint is refused.
    step = tmp_path / "two" / "checkpoint" / "step-2"
    victim = next(p for p in sorted(step.iterdir()) if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:-8] + b"\0" * 8)
    toml = tmp_path / "two.toml"
    with pytest.raises(CheckpointError, match="damaged"):
        run_isolated(_export, ["--out", str(tmp_path / "bad"), f"--job.config_file={toml}"])
