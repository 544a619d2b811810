"""Faults through the real training recipe: a resume with another hashing config is refused and
changes nothing in the run folder; non-finite steps are skipped, counted and finally stop the
run with an error naming the last good checkpoint; config validation names the key."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from launcher import in_turn, run_distributed
from small_job import small_job

from engram.checkpoint import CheckpointError, fingerprint_mismatches
from engram.checkpoint.fingerprint import config_fingerprint
from engram.config import ConfigError, config_from_dict, load_config
from engram.data.tokenizer import load_tokenizer
from engram.hashing.ngram import NgramHasher


def _raw(folder: str, steps: int = 2, **overrides: dict) -> dict:
    extra = {
        "training": {"seq_len": 16, "local_batch_size": 2},
        "data": {"synthetic_num_entities": 32},
        "optimizer": {"lr": 3e-4},
        "lr_scheduler": {"warmup_steps": 1},
        "checkpoint": {"enable": True, "interval": 2, "keep_latest_k": 0},
        "metrics": {"log_freq": 1},
    }
    raw = small_job(folder, "faults", 1, steps, extra, parallelism={})
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return raw


def poison_loss(nan_steps: tuple[int, ...]) -> None:
    """Fault injection for this (forked) process: the loss of the `nan_steps`-th loss calls is
    NaN, and so are their gradients."""
    import engram.train.loss

    real, calls = engram.train.loss.summed_cross_entropy, [0]

    def poisoned(logits, labels):
        calls[0] += 1
        loss = real(logits, labels)
        return loss * float("nan") if calls[0] in nan_steps else loss

    engram.train.loss.summed_cross_entropy = poisoned


def _train(rank: int, world: int, raw: dict, nan_steps: tuple[int, ...] = ()) -> dict:
    import recipes.train as recipe

    if nan_steps:
        poison_loss(nan_steps)
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("engram").addHandler(handler)
    try:
        result = recipe.train(config_from_dict(raw))
    except (CheckpointError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    weights = {
        n: p.detach().clone() for n, p in result.model.named_parameters() if "layers.0." in n
    }
    return {
        "losses": result.losses,
        "start": result.start_step,
        "weights": weights,
        "warned": warned,
    }


def _files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_resume_with_other_hashing_is_refused_and_changes_nothing(tmp_path):
    (first,) = run_distributed(_train, 1, _raw(str(tmp_path)))
    assert first["start"] == 0 and len(first["losses"]) == 2
    run = tmp_path / "faults"
    before = _files(run)
    assert "config.toml" in before and "checkpoint/step-2/manifest.json" in before
    for change, key in [
        ({"engram": {"seed": 1}}, "engram.hash_seed: checkpoint 0, this run 1"),
        ({"engram": {"compress_tokenizer": False}}, "engram.compress_tokenizer"),
        ({"engram": {"vocab_size_per_ngram": [1013, 997]}}, "engram.table_primes"),
        ({"engram": {"kernel_size": 3}}, "engram.kernel_size"),
    ]:
        (out,) = run_distributed(_train, 1, _raw(str(tmp_path), steps=4, **change))
        assert "different configuration" in out["error"] and key in out["error"], out
        assert _files(run) == before, change  # config record, metrics, checkpoints untouched
    # Harmless changes resume, data.num_workers included (the loader state is global).
    harmless = {"optimizer": {"lr": 1e-4}, "metrics": {"log_freq": 2}, "data": {"num_workers": 2}}
    (resumed,) = run_distributed(_train, 1, _raw(str(tmp_path), steps=3, **harmless))
    assert resumed["start"] == 2 and len(resumed["losses"]) == 1
    record = json.loads((run / "config.json").read_text())
    assert record["optimizer"]["lr"] == 1e-4  # written after the successful resume


def test_fingerprint_covers_meaning_not_harmless_settings():
    tok = load_tokenizer("")
    base = config_from_dict(_raw("/nonexistent"))

    def fp(raw: dict) -> dict:
        cfg = config_from_dict(raw)
        return config_fingerprint(
            cfg, tok, NgramHasher.from_config(cfg.engram, tok, tok.vocab_size)
        )

    ref = fp(_raw("/nonexistent"))
    meaningful = {
        "engram.hash_seed": {"engram": {"seed": 7}},
        "engram.pad_id": {"engram": {"pad_id": 5}},
        "engram.use_bias": {"engram": {"use_bias": True}},
        "engram.n_head_per_ngram": {"engram": {"n_head_per_ngram": 4}},
        "engram_layers": {"engram": {"layer_ids": [2]}},
        "training_mode": {"training": {"mode": "engram_only"}},
        "model_shape.vocab_size": {"model": {"vocab_size": 4096}},
    }
    for key, change in meaningful.items():
        diffs = fingerprint_mismatches(ref, fp(_raw("/nonexistent", **change)))
        assert any(d.startswith(key) for d in diffs), (key, diffs)
    harmless = {
        "optimizer": {"lr": 1.0, "weight_decay": 0.0},
        "training": {"steps": 99, "max_norm": 0.5},
        "data": {"num_workers": 3, "eval_batches": 2},
        "parallelism": {"dp_shard": 4},
        "engram": {"init": "identity", "table_init_std": 0.1},
    }
    assert fingerprint_mismatches(ref, fp(_raw("/nonexistent", **harmless))) == []
    assert base.engram.seed == 0


def test_nonfinite_steps_are_skipped_and_counted(tmp_path):
    raw = _raw(str(tmp_path), steps=4)
    raw["checkpoint"]["enable"] = False
    (clean,) = run_distributed(_train, 1, copy.deepcopy(raw))
    (skipped,) = run_distributed(_train, 1, copy.deepcopy(raw), (2, 3))
    assert math.isnan(skipped["losses"][1]) and math.isnan(skipped["losses"][2])
    assert skipped["losses"][0] == clean["losses"][0]
    for w in skipped["weights"].values():
        assert np.isfinite(w).all()
    records = [
        json.loads(line)
        for line in (tmp_path / "faults" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["nonfinite_steps"] for r in records[-4:]] == [0, 1, 2, 2]


def test_too_many_nonfinite_steps_stop_with_the_last_good_checkpoint(tmp_path):
    raw = _raw(str(tmp_path), steps=6, training={"max_nonfinite_steps": 2})
    (out,) = run_distributed(_train, 1, raw, (3, 4, 5, 6))
    assert "NonFiniteError" in out["error"] and "2 consecutive steps" in out["error"]
    assert str(tmp_path / "faults" / "checkpoint" / "step-2") in out["error"]


@pytest.mark.parametrize(
    "key,value",
    [
        ("optimizer.lr", "inf"),
        ("optimizer.lr", "-1"),
        ("optimizer.table_lr_mult", "inf"),
        ("optimizer.engram_lr_mult", "nan"),
        ("optimizer.weight_decay", "nan"),
        ("optimizer.weight_decay", "-0.1"),
        ("optimizer.table_weight_decay", "inf"),
        ("engram.table_init_std", "nan"),
        ("engram.table_init_std", "-0.02"),
        ("training.max_norm", "nan"),
        ("training.max_norm", "inf"),
        ("training.max_nonfinite_steps", "0"),
        ("checkpoint.on_damaged", "ignore"),
        ("job.run_name", "../escaped"),
        ("job.run_name", "a/../../escaped"),
        ("job.run_name", "/tmp/escaped"),
    ],
)
def test_bad_numbers_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config([f"--{key}={value}"])


def test_max_ngram_within_the_kernels():
    with pytest.raises(ConfigError, match=r"engram\.max_ngram = 17.*up to 16"):
        load_config(
            ["--engram.max_ngram=17", "--engram.vocab_size_per_ngram=" + ",".join(["101"] * 16)]
        )


def test_empty_config_file_warns(tmp_path, caplog):
    f = tmp_path / "empty.toml"
    f.write_text("# nothing here\n")
    with caplog.at_level("WARNING", logger="engram"):
        load_config([f"--job.config_file={f}"])
    assert "is empty" in caplog.text and str(f) in caplog.text


def test_tiny_tables_warn_with_the_collision_rate(caplog):
    from engram.train.table_check import collision_rates, warn_if_tables_collide

    tok = load_tokenizer("")
    tiny = config_from_dict({"engram": {"vocab_size_per_ngram": [101, 103], "n_head_per_ngram": 2}})
    hasher = NgramHasher.from_config(tiny.engram, tok, tok.vocab_size)
    with caplog.at_level("WARNING", logger="engram"):
        rates = warn_if_tables_collide(hasher)
    assert (
        rates[2] > 0.99
        and "engram.vocab_size_per_ngram" in caplog.text
        and "2-grams >= 100%" in caplog.text
    )
    default = config_from_dict({})  # the paper's sizes: no warning
    hasher = NgramHasher.from_config(default.engram, tok, tok.vocab_size)
    assert max(collision_rates(hasher).values()) < 0.01


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_changed_hyperparameters_apply_from_the_first_resumed_step(tmp_path):
    (first,) = run_distributed(_train, 1, _raw(str(tmp_path), steps=2))
    assert first["start"] == 0
    resume = {"checkpoint": {"load_step": 2}}
    wd = {"optimizer": {"weight_decay": 50.0}}
    lr = {"optimizer": {"lr": 3e-2}}
    # the three resumes of step 2, one after the other in one launch (the last one, `faster`,
    # writes the metrics read below)
    resumes = [_raw(str(tmp_path), steps=4, **resume, **change) for change in ({}, wd, lr)]
    ((same, decayed, faster),) = run_distributed(in_turn, 1, _train, resumes)
    for out in (same, decayed, faster):
        assert out["start"] == 2, out
    # Step 3's loss is computed before its update; its update (the first resumed one) uses
    # the new weight decay / lr, so step 4's loss differs.
    assert decayed["losses"][0] == same["losses"][0]
    assert decayed["losses"][1] != same["losses"][1]
    assert faster["losses"][1] != same["losses"][1]
    # The logged lr is the one the update used, from the new peak lr: step 3 is halfway through
    # the cosine decay (1 warmup step, 4 steps), step 4 reaches min_lr_ratio = 0.1.
    logged = {r["step"]: r["lr"] for r in _metrics(tmp_path / "faults") if "lr" in r}
    assert logged[3] == pytest.approx(3e-2 * 0.55) and logged[4] == pytest.approx(3e-3)


@pytest.mark.parametrize("mode", ["full", "engram_only"])
def test_logged_lr_is_the_applied_lr(tmp_path, mode):
    """optimizer.lr on its schedule in every mode: in engram_only the first param group is the
    Engram one (lr x engram_lr_mult), which must not become the logged lr."""
    opt = {"lr": 1e-3, "engram_lr_mult": 10.0}
    raw = _raw(str(tmp_path), steps=3, optimizer=opt, training={"mode": mode})
    raw["checkpoint"]["enable"] = False
    run_distributed(_train, 1, raw)
    logged = [r["lr"] for r in _metrics(tmp_path / "faults") if "lr" in r]
    # warmup_steps = 1: step 1 runs at lr / 2, step 2 at the peak, step 3 (last) at 0.1 x peak.
    assert logged == pytest.approx([5e-4, 1e-3, 1e-4])


def test_a_run_ending_in_nonfinite_steps_keeps_the_last_good_checkpoint(tmp_path):
    raw = _raw(str(tmp_path), steps=4)
    raw["checkpoint"].update(interval=1, keep_latest_k=1)
    (out,) = run_distributed(_train, 1, raw, (3, 4))
    ckpt = tmp_path / "faults" / "checkpoint"
    assert "NonFiniteError" in out.get("error", ""), out
    assert "ended with 2 non-finite step(s)" in out["error"]
    assert str(ckpt / "step-2") in out["error"]
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-2"]
    assert (ckpt / "latest").read_text().strip() == "2"


def test_resume_with_another_global_batch_warns(tmp_path):
    run_distributed(_train, 1, _raw(str(tmp_path), steps=2))
    (same,) = run_distributed(_train, 1, _raw(str(tmp_path), steps=3))
    assert same["start"] == 2 and not any("data consumption" in w for w in same["warned"])
    bigger = {"training": {"seq_len": 16, "local_batch_size": 4, "steps": 4}}
    (out,) = run_distributed(_train, 1, _raw(str(tmp_path), **bigger))
    assert out["start"] == 3, out
    assert any("global_batch_samples 2 -> 4" in w for w in out["warned"]), out["warned"]
