"""engram/train/flops.py: the FLOPs per token of a small model against a count by hand, in every
training mode (the hand count is written out term by term; the module docstring states the rules)."""

from __future__ import annotations

import pytest

from engram.config import Engram, Lora
from engram.models.args import ModelArgs
from engram.models.lora import add_lora_adapters
from engram.models.transformer import Transformer
from engram.train.flops import count_flops

T = 64  # seq_len
D, L, H, KV, Q, F, V = 16, 3, 4, 2, 4, 32, 50  # dim, layers, heads, kv heads, head_dim, ffn, vocab
ENGRAM_LAYER = 1

# One decoder layer's weights: attention_norm D, wq D*H*Q, wk D*KV*Q, wv D*KV*Q, wo H*Q*D,
# ffn_norm D, w1 / w3 D*F, w2 F*D.
LAYER = D + D * H * Q + 2 * D * KV * Q + H * Q * D + D + 3 * D * F
assert LAYER == 16 + 256 + 128 + 128 + 256 + 16 + 3 * 512 == 2336
# The Engram block at layer 1 (engram_dim E = (max_ngram - 1) * n_embed_per_ngram = 2 * 8 = 16;
# no biases): value_proj E*D, key_projs[0] E*D, key_norms D, query_norms D, short_conv norms D,
# depthwise conv D * kernel 4. The table is a gather: not counted.
E = 16
ENGRAM = E * D + E * D + D + D + D + D * 4
assert ENGRAM == 256 + 256 + 16 + 16 + 16 + 64 == 624
HEAD = D + D * V  # final norm + output head (the token embedding, a gather, is not counted)
ATTN_LAYER = 12 * H * Q * T  # per layer with backward
GATE = 6 * 1 * D  # hc_mult 1: <key, query> over D, forward 2 D + backward 4 D


def _model(tied: bool = False) -> Transformer:
    args = ModelArgs(
        dim=D, n_layers=L, n_heads=H, n_kv_heads=KV, ffn_dim=F, vocab_size=V,
        tie_embeddings=tied, max_seq_len=T,
    )  # fmt: skip
    engram = Engram(
        layer_ids=[ENGRAM_LAYER], n_head_per_ngram=2, n_embed_per_ngram=8,
        vocab_size_per_ngram=[97, 101],
    )  # fmt: skip
    return Transformer(args, engram, {ENGRAM_LAYER: 1000})


def test_full_mode_is_6n_plus_attention_plus_gate() -> None:
    got = count_flops(_model(), T, "full")
    n = L * LAYER + ENGRAM + HEAD
    assert (got.trained_params, got.frozen_params, got.forward_only_params) == (n, 0, 0)
    assert got.attention == L * ATTN_LAYER == 3 * 12 * 4 * 4 * 64
    assert got.engram_gate == GATE
    assert got.per_token == 6 * n + L * ATTN_LAYER + GATE


def test_tied_embedding_counts_once_as_the_head() -> None:
    got = count_flops(_model(tied=True), T, "full")
    assert got.trained_params == L * LAYER + ENGRAM + HEAD  # D * V once, not twice


def test_engram_only_layers_before_the_first_engram_layer_have_no_backward() -> None:
    got = count_flops(_model(), T, "engram_only")
    # Layer 0 comes before the first trainable layer (1): forward only, 2 per weight and 4 H Q T
    # of attention. Layers 1, 2 and the head are frozen with an input gradient: 4 per weight.
    assert got.trained_params == ENGRAM
    assert got.forward_only_params == LAYER
    assert got.frozen_params == 2 * LAYER + HEAD
    assert got.attention == 4 * H * Q * T + 2 * ATTN_LAYER
    assert got.per_token == (
        6 * ENGRAM + 2 * LAYER + 4 * (2 * LAYER + HEAD) + 4 * H * Q * T + 2 * ATTN_LAYER + GATE
    )


@pytest.mark.parametrize("converted", [False, True])
def test_lora_counts_adapters_as_trained_and_the_backbone_4n(converted: bool) -> None:
    lora = Lora(rank=2, target_modules=["q_proj", "v_proj", "down_proj"])
    model = _model()
    if converted:  # the model as parallelisms/lora.py leaves it: the same count
        add_lora_adapters(model, lora)
    got = count_flops(model, T, "lora", lora)
    # Adapters per layer: r * (in + out) for wq (D -> H*Q), wv (D -> KV*Q), w2 (F -> D).
    adapters = 2 * (D + H * Q) + 2 * (D + KV * Q) + 2 * (F + D)
    assert adapters == 64 + 48 + 96
    assert got.trained_params == L * adapters + ENGRAM
    assert got.forward_only_params == 0  # layer 0 has adapters: every layer has a backward
    assert got.frozen_params == L * LAYER + HEAD
    assert got.per_token == (
        6 * (L * adapters + ENGRAM) + 4 * (L * LAYER + HEAD) + L * ATTN_LAYER + GATE
    )


def test_describe_names_every_term() -> None:
    text = count_flops(_model(), T, "engram_only").describe()
    for part in ("trained", "frozen", "forward-only", "attention", "Engram gate", "T = 64"):
        assert part in text
