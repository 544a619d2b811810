"""Parity with Hugging Face transformers itself (a dev dependency only: `pip install -e .[dev]`).

Tiny random Llama-3, Llama-3.1 (llama3 rope scaling), Llama-3.2-style tied, Qwen2 and Qwen3
(untied and tied) models are built in transformers, saved with save_pretrained (transformers 5
writes the rope_parameters layout; one case is rewritten to the transformers 4 layout), and loaded
through the recipes' path: model.flavor = "hf" + model.hf_checkpoint -> build on meta ->
to_empty -> init -> load_hf_backbone (engram/inference/'s build_for_generation + load_weights).
Logits are compared at a length beyond the rope-scaling boundary, with Engram (identity init) on
and off, and greedy generation token for token. The HF vocabulary (2112 rows) is larger than the
debug tokenizer (2048 tokens), as Qwen2.5 pads its output rows.

transformers runs only in one forked child: importing it creates nn.Module instances at module
level, which would outlive every test of this pytest process (tests/test_runtime_teardown.py counts them).
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from launcher import run_isolated

from engram.config import config_from_dict
from engram.inference import build_for_generation, generate, load_weights
from engram.models.transformer import rope_cos_sin

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed: pip install -e '.[dev]' for the HF parity tests",
)

TOKENS = 2048  # the debug tokenizer
VOCAB = 2112  # > TOKENS: padded rows, as Qwen2.5's
SEQ = 48  # > ORIGINAL (the llama3 rope-scaling boundary)
ORIGINAL = 16
NEW = 8
SMALL = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
}  # fmt: skip
LLAMA31_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0,
}  # fmt: skip

# case -> (model.name, transformers config class, config kwargs)
CASES = {
    "llama3": ("llama3", "LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
    "llama3.1": ("llama3", "LlamaConfig", {"rope_parameters": LLAMA31_ROPE}),
    "llama3.2_tied": (
        "llama3", "LlamaConfig", {"rope_parameters": LLAMA31_ROPE, "tie_word_embeddings": True},
    ),
    "qwen2": ("qwen2", "Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("qwen3", "Qwen3Config", {"head_dim": 32, "rms_norm_eps": 1e-6}),
    "qwen3_tied": ("qwen3", "Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    "llama3.1_v4_config": ("llama3", "LlamaConfig", {"rope_parameters": LLAMA31_ROPE}),
}  # fmt: skip


def _ids(seq: int) -> torch.Tensor:
    return torch.randint(0, TOKENS, (2, seq), generator=torch.Generator().manual_seed(3))


def _v4_layout(folder) -> None:
    """Rewrite config.json the way transformers 4 wrote it (rope_theta / rope_scaling on top)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config.pop("layer_types", None)
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    path.write_text(json.dumps(config))


def _transformers_side(root) -> dict[str, dict]:
    """In a forked child: per case, build the transformers model, save it, and return its
    logits on _ids(SEQ) and its greedy continuation of _ids(ORIGINAL + 4) (padded rows
    suppressed), as numpy."""
    import transformers

    out = {}
    for case, (_, config_cls, extra) in CASES.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**{**SMALL, **extra})
        config._attn_implementation = "sdpa"
        model = getattr(transformers, config_cls.replace("Config", "ForCausalLM"))(config).eval()
        with torch.no_grad():  # non-trivial biases / norms, so a dropped or misplaced one shows
            for n, p in model.named_parameters():
                if n.endswith(".bias") or "norm" in n:
                    p.normal_(1.0 if "norm" in n else 0.0, 0.1)
        folder = root / case
        model.save_pretrained(folder)
        if case.endswith("_v4_config"):
            _v4_layout(folder)
        with torch.no_grad():
            logits = model(_ids(SEQ)).logits
            greedy = model.generate(
                _ids(ORIGINAL + 4), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                pad_token_id=0, eos_token_id=None, suppress_tokens=list(range(TOKENS, VOCAB)),
            )  # fmt: skip
        out[case] = {
            "logits": logits.numpy(),
            "greedy": greedy.numpy(),
            "tied": bool(config.tie_word_embeddings),
        }
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return root, run_isolated(_transformers_side, root, timeout=600)


def _ours(name: str, folder, engram: bool, seq: int):
    raw = {
        "job": {"device": "cpu", "seed": 1, "dump_folder": str(folder / "runs")},
        "model": {"name": name, "flavor": "hf", "hf_checkpoint": str(folder)},
        "engram": {
            "enabled": engram, "layer_ids": [1], "n_head_per_ngram": 2,
            "vocab_size_per_ngram": [1009, 997], "n_embed_per_ngram": 32, "init": "identity",
        },
    }  # fmt: skip
    cfg = config_from_dict(raw)
    model, tokenizer, hasher = build_for_generation(cfg, seq)
    assert tokenizer.vocab_size == TOKENS
    assert load_weights(model, cfg, source="hf").startswith("HF checkpoint")
    return model, hasher


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("engram", [False, True], ids=["plain", "engram_identity"])
def test_logits_match_transformers(reference, case, engram):
    root, theirs = reference
    ours, hasher = _ours(CASES[case][0], root / case, engram, SEQ)
    assert ours.args.tie_embeddings == theirs[case]["tied"]
    if ours.args.tie_embeddings:
        assert ours.output.weight is ours.tok_embeddings.weight
    assert (ours.args.rope_scaling is not None) == ("llama3.1" in case or "3.2" in case)
    ids = _ids(SEQ)
    want = torch.from_numpy(theirs[case]["logits"])
    with torch.no_grad():
        got = ours(ids, hash_ids=hasher.hash_torch(ids) if engram else None)
    assert got.shape == want.shape == (2, SEQ, VOCAB)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # bit-exact on x86 CPU
    if ours.args.rope_scaling is not None:  # not vacuous: without the scaling it differs
        ours.rope_cache = rope_cos_sin(ours.args.replace(rope_scaling=None))
        with torch.no_grad():
            assert not torch.allclose(
                ours(ids, hash_ids=hasher.hash_torch(ids) if engram else None), want
            )


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_transformers(reference, case):
    """Greedy with Engram (identity) on; the padded rows are suppressed on both sides."""
    root, theirs = reference
    ours, hasher = _ours(CASES[case][0], root / case, True, ORIGINAL + 4 + NEW)
    got = generate(ours, _ids(ORIGINAL + 4), hasher, NEW, vocab_size=TOKENS)
    assert np.array_equal(got.numpy(), theirs[case]["greedy"])
