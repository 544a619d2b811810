"""engram/inference/ and recipes/generate.py: greedy decoding, on-device hash ids, agreement with one full forward, and
loading a DCP checkpoint written by a 2-rank FSDP2 training run into the unsharded model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from launcher import run_distributed
from safetensors.torch import save_file
from small_job import small_job
from torch.distributed.tensor import DTensor

from engram.checkpoint import CheckpointError
from engram.config import config_from_dict, to_toml
from engram.data.tokenizer import load_tokenizer
from engram.hf.adapter import to_hf_state_dict
from engram.inference import (
    build_for_generation,
    encode_prompt,
    generate,
    load_weights,
    sample_next,
)
from engram.models.decode_cache import DecodeCache
from recipes.generate import main

NEW = 5


def _raw(folder: str = "unused", steps: int = 3) -> dict:
    extra = {  # paper init: Engram contributes, so wrong hash ids would change the tokens
        "job": {"seed": 7},
        "training": {"local_batch_size": 2},
        "data": {"synthetic_num_entities": 32},
        "optimizer": {"lr": 3e-4},
        "lr_scheduler": {"warmup_steps": 1},
        "checkpoint": {"enable": True, "interval": 100, "keep_latest_k": 0},
        "metrics": {"log_freq": 1},
    }
    return small_job(folder, "gen", 2, steps, extra)


@pytest.fixture(scope="module")
def fresh():
    cfg = config_from_dict(_raw())
    model, tokenizer, hasher = build_for_generation(cfg, 32)
    prompts = torch.tensor(
        [
            encode_prompt(tokenizer, "The capital of", "eos")[:4],
            encode_prompt(tokenizer, "The flag of Zorb", "eos")[:4],
        ]
    )
    return model, tokenizer, hasher, prompts


def test_greedy_is_deterministic(fresh):
    model, _, hasher, prompts = fresh
    out = generate(model, prompts, hasher, NEW)
    assert out.shape == (2, prompts.shape[1] + NEW)
    assert torch.equal(out[:, : prompts.shape[1]], prompts)
    assert torch.equal(generate(model, prompts, hasher, NEW), out)
    # A second model built from the same config (same seed) decodes the same tokens.
    again, _, hasher2 = build_for_generation(config_from_dict(_raw()), 32)
    assert torch.equal(generate(again, prompts, hasher2, NEW), out)


def test_on_device_hash_ids_match_numpy(fresh):
    model, _, hasher, prompts = fresh
    ids = generate(model, prompts, hasher, NEW)
    expected = hasher(ids.numpy())
    assert np.array_equal(hasher._hash_torch_ops(ids, None).numpy(), expected)
    assert np.array_equal(hasher.hash_torch(ids).numpy(), expected)
    # Causal: the ids of a prefix are the prefix of the ids, so per-step recomputation is exact.
    t = prompts.shape[1] + 2
    assert np.array_equal(hasher._hash_torch_ops(ids[:, :t], None).numpy(), expected[:, :t])


def test_stepwise_agrees_with_one_full_forward(fresh):
    model, _, hasher, prompts = fresh
    out = generate(model, prompts, hasher, NEW)
    p = prompts.shape[1]
    with torch.no_grad():
        logits = model(out[:, :-1], hash_ids=hasher.hash_torch(out[:, :-1]))
    assert torch.equal(logits[:, p - 1 :].argmax(-1), out[:, p:])
    # Engram matters here: decoding with wrong hash ids gives other logits.
    wrong = torch.zeros_like(hasher.hash_torch(out[:, :-1]))
    with torch.no_grad():
        assert not torch.allclose(model(out[:, :-1], hash_ids=wrong), logits)


@pytest.mark.parametrize("prompt_len", [1, 14])
def test_cached_decoding_equals_uncached(fresh, prompt_len):
    """KV cache + Engram windows: the same greedy tokens as recomputing the whole sequence, and
    the same logits at every step up to float noise (prompts shorter and longer than the
    hash and ShortConv windows)."""
    model, _, hasher, _ = fresh
    prompts = torch.randint(0, 2000, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    new = 24 - prompt_len
    cached = generate(model, prompts, hasher, new)
    assert torch.equal(cached, generate(model, prompts, hasher, new, use_cache=False))
    cache = DecodeCache()
    with torch.no_grad():
        full = model(cached, hash_ids=hasher.hash_torch(cached))
        steps = [
            model(
                cached[:, :prompt_len],
                hash_ids=hasher.hash_torch(cached[:, :prompt_len]),
                cache=cache,
            )
        ]
        for t in range(prompt_len, cached.shape[1]):
            window = cached[:, max(0, t - 2) : t + 1]
            steps.append(
                model(cached[:, t : t + 1], hash_ids=hasher.hash_torch(window)[:, -1:], cache=cache)
            )
    assert cache.pos == cached.shape[1]
    with torch.no_grad():  # the prefill is the uncached forward of the prompt, bit for bit
        prompt = cached[:, :prompt_len]
        assert torch.equal(steps[0], model(prompt, hash_ids=hasher.hash_torch(prompt)))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_sampling(fresh):
    model, _, hasher, prompts = fresh

    def sample(seed: int, top_k: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return generate(model, prompts, hasher, NEW, temperature=1.0, top_k=top_k, generator=gen)

    assert torch.equal(sample(0, 0), sample(0, 0))
    assert torch.equal(sample(3, 1), generate(model, prompts, hasher, NEW))  # top-1 = greedy
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    picks = {int(sample_next(logits, 1.0, 2, torch.Generator().manual_seed(s))) for s in range(50)}
    assert picks == {1, 3}


def test_stops_at_eos(fresh):
    model, _, hasher, prompts = fresh
    greedy = generate(model, prompts[:1], hasher, NEW)
    eos = int(greedy[0, prompts.shape[1]])  # pretend the first generated token ends the text
    out = generate(model, prompts[:1], hasher, NEW, eos_id=eos)
    assert out.shape[1] == prompts.shape[1] + 1


def _train(rank: int, world: int, raw: dict) -> dict[str, torch.Tensor]:
    from recipes.train import train

    result = train(config_from_dict(raw))
    assert result.model is not None
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in result.model.named_parameters()
    }


@pytest.mark.slow
def test_loads_checkpoint_written_at_world_2(tmp_path, capsys):
    raw = _raw(str(tmp_path))
    cfg = config_from_dict(raw)
    model, _, _ = build_for_generation(cfg, 32)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_weights(model, cfg, "checkpoint")
    with pytest.raises(ValueError, match="model.hf_checkpoint"):
        load_weights(model, cfg, "hf")

    trained = run_distributed(_train, 2, raw)[0]
    assert (tmp_path / "gen" / "checkpoint" / "step-3").is_dir()
    model, _, _ = build_for_generation(cfg, 32)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    source = load_weights(model, cfg)
    assert "step-3" in source
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(trained)
    for name, value in trained.items():
        assert not isinstance(got[name], DTensor)
        assert np.array_equal(got[name].detach().numpy(), value), name
    table = "layers.1.engram.table.weight"
    assert not torch.equal(init[table], got[table]), "training did not change the table"
    with pytest.raises(CheckpointError, match=r"no step-2; its checkpoints: steps \[3\]"):
        load_weights(model, cfg, "auto", checkpoint_step=2)
    # The fingerprint training compares: other layers, and other hashing (same tables).
    for section, key, value, diff in [
        ("engram", "layer_ids", [2], "engram_layers"),
        ("engram", "seed", 7, "engram.hash_seed: checkpoint 0, this run 7"),
    ]:
        other_raw = _raw(str(tmp_path))
        other_raw[section][key] = value
        other = config_from_dict(other_raw)
        with pytest.raises(CheckpointError, match=diff):
            load_weights(build_for_generation(other, 32)[0], other)

    # The command line, on the same run folder.
    config_file = tmp_path / "gen.toml"
    config_file.write_text(to_toml(cfg))
    completion = main(
        [
            "--job.config_file",
            str(config_file),
            "--prompt",
            "The capital of",
            "--max_new_tokens",
            "3",
        ]
    )
    assert len(completion) > 0
    assert f"The capital of{completion}" in capsys.readouterr().out

    # The only checkpoint damaged: refused naming it, never random weights.
    shard = tmp_path / "gen" / "checkpoint" / "step-3" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for source in ("auto", "checkpoint"):
        with pytest.raises(CheckpointError, match=r"step-3.*damaged bytes"):
            load_weights(build_for_generation(cfg, 32)[0], cfg, source)


def test_prompt_longer_than_trained_warns(caplog):
    from engram.inference import warn_if_longer_than_trained

    cfg = config_from_dict(_raw())  # training.seq_len 32
    with caplog.at_level("WARNING", logger="engram"):
        warn_if_longer_than_trained(cfg, 20, 12)
    assert caplog.text == ""
    with caplog.at_level("WARNING", logger="engram"):
        warn_if_longer_than_trained(cfg, 40, 5)
    assert "exceed training.seq_len = 32" in caplog.text


def _padded_model(tmp_path):
    """The recipe's model with 64 output rows past the tokenizer (as Qwen2.5: 152,064 rows for
    151,665 tokens) whose logits win: the real rows' weights are zero."""
    raw = _raw(str(tmp_path))
    raw["parallelism"] = {}
    vocab = load_tokenizer("").vocab_size
    raw["model"]["vocab_size"] = vocab + 64
    cfg = config_from_dict(raw)
    model, tokenizer, hasher = build_for_generation(cfg, 32)
    with torch.no_grad():
        model.output.weight[:vocab] = 0.0
    return raw, model, tokenizer, hasher


def test_padded_vocab_rows_are_never_generated(tmp_path):
    raw, model, tokenizer, hasher = _padded_model(tmp_path)
    prompts = torch.tensor([encode_prompt(tokenizer, "The capital of", "eos")[:4]] * 2)
    with torch.no_grad():  # not vacuous: unmasked, a padded row is the argmax
        assert (
            int(model(prompts, hash_ids=hasher.hash_torch(prompts))[0, -1].argmax())
            >= tokenizer.vocab_size
        )
    with pytest.raises(ValueError, match="the hasher was built for"):  # the defect, unmasked
        generate(model, prompts, hasher, NEW)
    out = generate(model, prompts, hasher, NEW, vocab_size=tokenizer.vocab_size)
    assert out.shape[1] == prompts.shape[1] + NEW
    assert int(out.max()) < tokenizer.vocab_size
    with pytest.raises(ValueError, match="vocab_size"):
        generate(model, prompts, hasher, NEW, vocab_size=model.args.vocab_size + 1)


def test_main_masks_padded_rows_of_an_hf_folder(tmp_path, capsys):
    """recipes/generate.py main() on an HF folder whose padded output rows dominate: it decodes
    only tokenizer ids (sampling and greedy) and never crashes the Engram hasher."""
    raw, model, tokenizer, _ = _padded_model(tmp_path)
    sd = {n: t for n, t in model.state_dict().items() if ".engram." not in f".{n}"}
    hf = to_hf_state_dict(sd, model.args)
    (tmp_path / "hf").mkdir()
    save_file(
        {k: v.contiguous() for k, v in hf.items()}, str(tmp_path / "hf" / "model.safetensors")
    )
    raw["model"]["hf_checkpoint"] = str(tmp_path / "hf")
    (tmp_path / "cfg.toml").write_text(to_toml(config_from_dict(raw)))
    for flags in (["--temperature", "0"], ["--temperature", "1.0", "--top_k", "5"]):
        completion = main(
            ["--job.config_file", str(tmp_path / "cfg.toml"), "--source", "hf",
             "--prompt", "The capital of", "--max_new_tokens", "4", *flags]
        )  # fmt: skip
        assert isinstance(completion, str)
