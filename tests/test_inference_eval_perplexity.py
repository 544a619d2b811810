"""scripts/eval_perplexity.py: held-out perplexity of a checkpoint on prepared token shards
(data.dataset = "tokens"), without launching training."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launcher import run_distributed, run_isolated
from small_job import small_job

import engram.data.prepare as prep
from engram.config import config_from_dict, to_toml
from engram.data.loader import build_dataloader
from engram.data.synthetic import SyntheticFacts
from engram.inference import build_for_generation

ROOT = Path(__file__).resolve().parents[1]


def _raw(tmp_path: Path) -> dict:
    extra = {
        "job": {"seed": 2},
        "data": {
            "dataset": "tokens",
            "path": str(tmp_path / "prepared"),
            "synthetic_num_entities": 512,
        },
        "training": {"local_batch_size": 2},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 10},
        "checkpoint": {"enable": True, "interval": 3},
        "metrics": {"log_freq": 1},
    }
    return small_job(str(tmp_path), "ppl", 1, 3, extra, parallelism={})


def _script(argv: list[str]) -> dict:
    spec = importlib.util.spec_from_file_location("ppl", ROOT / "scripts" / "eval_perplexity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def _train(rank: int, world: int, raw: dict) -> None:
    from recipes.train import train

    train(config_from_dict(raw))


def test_heldout_perplexity_of_init_and_checkpoint(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    facts = SyntheticFacts(1, 48, 1, "train")
    (corpus / "a.jsonl").write_text(
        "".join(json.dumps({"text": facts[i]}) + "\n" for i in range(400))
    )
    prep.prepare([str(corpus)], tmp_path / "prepared", prep.Options(), progress=False)
    raw = _raw(tmp_path)
    toml = tmp_path / "ppl.toml"
    toml.write_text(to_toml(config_from_dict(raw)))

    got = _script([f"--job.config_file={toml}", "--source", "init", "--batches", "3"])
    assert got["tokens"] == 3 * 2 * 32
    # By hand: the init model on the loader's first three held-out batches.
    cfg = config_from_dict(raw)
    model, tokenizer, hasher = build_for_generation(cfg, 32)
    loader = iter(build_dataloader(cfg, tokenizer, hasher, 0, 1, split="val"))
    losses = []
    with torch.no_grad():
        for _ in range(3):
            batch = next(loader)
            logits = model(batch["input_ids"], hash_ids=batch["hash_ids"])
            losses.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))
    want = float(torch.stack(losses).mean())
    assert got["loss"] == pytest.approx(want, rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(want), rel=1e-6)
    assert "perplexity" in capsys.readouterr().out

    run_distributed(_train, 1, raw)  # a checkpoint at step 3
    trained = run_isolated(_script, [f"--job.config_file={toml}", "--batches", "3"])
    assert trained["tokens"] == got["tokens"] and trained["loss"] < got["loss"]
