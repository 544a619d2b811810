"""Dense model family: shapes, switches, causality, meta build + init, big-flavor sizes, errors,
and the HF state-dict adapter."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from engram.config import Engram as EngramConfig
from engram.config import Model as ModelConfig
from engram.hf.adapter import from_hf_state_dict, to_hf_state_dict
from engram.models import MODEL_FLAVORS, build_model, get_model_args, model_args_for
from engram.models.transformer import Attention, clean_fqn, rope_cos_sin, rope_inv_freq

torch.set_num_threads(2)

VOCAB = 300
TABLE_ROWS = {0: 410, 1: 401, 2: 433, 3: 397}


def engram_cfg(**kw) -> EngramConfig:
    base = dict(
        layer_ids=[1, 3],
        n_head_per_ngram=4,
        vocab_size_per_ngram=[50, 60],
        n_embed_per_ngram=32,
        init="paper",
    )
    base.update(kw)
    return EngramConfig(**base)


def debug_model(name: str, cfg: EngramConfig | None = None, seed: int = 0):
    cfg = cfg or engram_cfg()
    model = build_model(ModelConfig(name=name), cfg, VOCAB, TABLE_ROWS, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def batch(model, b: int = 2, t: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (b, t), generator=g)
    if not model.engram_layer_order:
        return x, None
    heads = model.engram_cfg.num_heads
    ids = torch.randint(0, 397, (b, t, len(model.engram_layer_order), heads), generator=g)
    return x, ids


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_debug_flavor_shapes(name: str) -> None:
    model = debug_model(name)
    x, ids = batch(model)
    logits = model(x, hash_ids=ids)
    assert logits.shape == (2, 12, VOCAB) and torch.isfinite(logits).all()
    assert model.engram_layer_order == [1, 3]
    assert [i for i, layer in model.layers.items() if layer.engram is not None] == ["1", "3"]
    args = model.args
    attn = model.layers["0"].attention
    assert attn.wk.out_features == args.n_kv_heads * args.head_dim
    assert (attn.wq.bias is not None) == (name == "qwen2")
    assert (attn.q_norm is not None) == (name == "qwen3")


def test_switches_have_effect() -> None:
    for name, attr in (("qwen2", "bias"), ("qwen3", "norm")):
        model = debug_model(name)
        x, ids = batch(model)
        before = model(x, hash_ids=ids)
        attn = model.layers["0"].attention
        with torch.no_grad():
            if attr == "bias":
                attn.wk.bias.normal_()
            else:
                attn.q_norm.weight.mul_(3.0)
        assert not torch.allclose(model(x, hash_ids=ids), before), name


def _meta_layout(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo HF's convert permutation: rotate-half rows -> Meta's interleaved-pair rows."""
    out_dim, dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, dim).transpose(1, 2).reshape(out_dim, dim)


def _reference_attention(attn: Attention, x: torch.Tensor, args) -> torch.Tensor:
    """Independent attention: Meta-layout weights, complex-pair RoPE, explicit GQA head map,
    explicit causal mask. Equal to ours iff our RoPE is HF's rotate-half convention."""
    b, t, _ = x.shape
    hd, nh, nkv = args.head_dim, args.n_heads, args.n_kv_heads
    q = (x @ _meta_layout(attn.wq.weight, nh).T).view(b, t, nh, hd // 2, 2)
    k = (x @ _meta_layout(attn.wk.weight, nkv).T).view(b, t, nkv, hd // 2, 2)
    v = (x @ attn.wv.weight.T).view(b, t, nkv, hd)
    inv = rope_inv_freq(hd, args.rope_theta, args.rope_scaling).double()
    rot = torch.polar(
        torch.ones(t, hd // 2, dtype=torch.float64), torch.outer(torch.arange(t), inv)
    )
    qc = torch.view_as_complex(q.double().contiguous()) * rot[:, None]
    kc = torch.view_as_complex(k.double().contiguous()) * rot[:, None]
    q, k = torch.view_as_real(qc).flatten(-2), torch.view_as_real(kc).flatten(-2)
    out = torch.empty(b, t, nh, hd, dtype=torch.float64)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for h in range(nh):
        kv = h // (nh // nkv)
        s = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(hd)
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        out[:, :, h] = p @ v[:, :, kv].double()
    return out.reshape(b, t, nh * hd).float() @ attn.wo.weight.T


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_attention_matches_reference(name: str) -> None:
    cfg = engram_cfg(enabled=False)
    model = debug_model(name, cfg)
    args = model.args.replace(rope_scaling=None)
    attn = Attention(args)
    attn.load_state_dict(model.layers["0"].attention.state_dict())
    with torch.no_grad():  # the reference has no biases
        for lin in (attn.wq, attn.wk, attn.wv):
            if lin.bias is not None:
                lin.bias.zero_()
    x = torch.randn(2, 10, args.dim)
    cos_sin = rope_cos_sin(args)
    ours = attn(x, cos_sin[0, :10], cos_sin[1, :10])
    torch.testing.assert_close(ours, _reference_attention(attn, x, args), rtol=1e-4, atol=1e-5)


def test_llama3_rope_scaling() -> None:
    args = get_model_args("llama3", "8B")
    s = args.rope_scaling
    base = rope_inv_freq(args.head_dim, args.rope_theta, None)
    scaled = rope_inv_freq(args.head_dim, args.rope_theta, s)
    wavelen = 2 * math.pi / base
    high = wavelen < s.original_max_position_embeddings / s.high_freq_factor
    low = wavelen > s.original_max_position_embeddings / s.low_freq_factor
    assert high.any() and low.any() and (~high & ~low).any()
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / s.factor)
    mid = ~high & ~low
    assert ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / s.factor)).all()


def test_causal_masking() -> None:
    model = debug_model("llama3")
    x, ids = batch(model, t=16)
    x2, ids2 = x.clone(), ids.clone()
    x2[:, 9:] = (x2[:, 9:] + 1) % VOCAB
    ids2[:, 9:] = (ids2[:, 9:] + 5) % 397
    a, b = model(x, hash_ids=ids), model(x2, hash_ids=ids2)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_meta_build_init_is_deterministic() -> None:
    a = debug_model("qwen3", seed=3)
    b = debug_model("qwen3", seed=3)
    c = debug_model("qwen3", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.isfinite(sa[k]).all(), k
        assert torch.equal(sa[k], sb[k]), k
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    # Norms 1, biases 0, distinct random matrices.
    assert torch.equal(sa["norm.weight"], torch.ones_like(sa["norm.weight"]))
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sa["layers.1.attention.wq.weight"])
    std = sa["layers.2.feed_forward.w1.weight"].std().item()
    assert abs(std - 0.02) < 0.002
    torch.testing.assert_close(a.rope_cache, rope_cos_sin(a.args))


def test_init_independent_of_wrapping() -> None:
    plain = debug_model("llama3", seed=1)
    model = build_model(ModelConfig(), engram_cfg(), VOCAB, TABLE_ROWS, device="meta")
    for key in list(model.layers):
        model.layers[key] = checkpoint_wrapper(model.layers[key])
    model.to_empty(device="cpu")
    model.init_weights(1)
    wrapped = {clean_fqn(k): v for k, v in model.state_dict().items()}
    ref = plain.state_dict()
    assert wrapped.keys() == ref.keys()
    assert all(torch.equal(wrapped[k], ref[k]) for k in ref)
    x, ids = batch(plain)
    torch.testing.assert_close(model(x, hash_ids=ids), plain(x, hash_ids=ids))


def _expected_params(args) -> int:
    """Independent count from the published architecture description."""
    d, hd = args.dim, args.head_dim
    q, kv = args.n_heads * hd, args.n_kv_heads * hd
    attn = d * q + 2 * d * kv + q * d
    if args.qkv_bias:
        attn += q + 2 * kv
    if args.qk_norm:
        attn += 2 * hd
    layer = attn + 3 * d * args.ffn_dim + 2 * d
    emb = args.vocab_size * d * (1 if args.tie_embeddings else 2)
    return args.n_layers * layer + d + emb


BIG = [(n, f) for n, fl in MODEL_FLAVORS.items() for f in fl if f != "mid" and "debug" not in f]


@pytest.mark.parametrize("name,flavor", BIG)
def test_big_flavors_on_meta(name: str, flavor: str) -> None:
    model = build_model(
        ModelConfig(name=name, flavor=flavor), engram_cfg(enabled=False), 0, {}, device="meta"
    )
    n = sum(p.numel() for p in model.parameters())
    assert n == _expected_params(model.args)
    published = {
        ("llama3", "8B"): 8_030_261_248,
        ("qwen2", "7B"): 7_615_616_512,
        ("qwen2", "32B"): 32_763_876_352,
    }
    if (name, flavor) in published:
        assert n == published[(name, flavor)]


def test_engram_parameter_count() -> None:
    cfg = engram_cfg()
    model = build_model(ModelConfig(name="llama3", flavor="8B"), cfg, 0, TABLE_ROWS, device="meta")
    d, e = model.args.dim, cfg.n_embed_per_ngram * (cfg.max_ngram - 1)
    per_layer = lambda rows: rows * cfg.head_dim + 2 * e * d + 2 * d + d + 4 * d  # noqa: E731
    expected = sum(per_layer(TABLE_ROWS[i]) for i in cfg.layer_ids)
    got = sum(p.numel() for n, p in model.named_parameters() if ".engram." in n)
    assert got == expected


def test_bad_configs_have_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"valid ids are 0\.\.3"):
        build_model(ModelConfig(), engram_cfg(layer_ids=[4]), VOCAB, {4: 100})
    with pytest.raises(ValueError, match="hc_mult = 1"):
        build_model(ModelConfig(), engram_cfg(hc_mult=2), VOCAB, TABLE_ROWS)
    with pytest.raises(ValueError, match="table_rows"):
        build_model(ModelConfig(), engram_cfg(layer_ids=[1]), VOCAB, {})
    with pytest.raises(ValueError, match="valid: debug, mid, 8B"):
        build_model(ModelConfig(flavor="70B"), engram_cfg(), VOCAB, TABLE_ROWS)
    with pytest.raises(ValueError, match="valid: llama3, qwen2, qwen3"):
        get_model_args("gpt2", "debug")
    with pytest.raises(ValueError, match="tokenizer has 200000 tokens"):
        model_args_for(ModelConfig(flavor="8B"), 200_000)
    with pytest.raises(ValueError, match="no fixed vocabulary"):
        model_args_for(ModelConfig(), 0)
    model = debug_model("llama3")
    x, ids = batch(model)
    with pytest.raises(ValueError, match="pass hash_ids"):
        model(x)
    with pytest.raises(ValueError, match="hash_ids shape"):
        model(x, hash_ids=ids[:, :, :1])
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, model.args.max_seq_len + 1, dtype=torch.long), hash_ids=None)


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_hf_round_trip(name: str) -> None:
    model = debug_model(name)
    sd = model.state_dict()
    hf = to_hf_state_dict(sd, model.args)
    assert "model.layers.0.self_attn.q_proj.weight" in hf and "lm_head.weight" in hf
    assert ("model.layers.0.self_attn.q_proj.bias" in hf) == (name == "qwen2")
    assert ("model.layers.0.self_attn.k_norm.weight" in hf) == (name == "qwen3")
    assert "engram.layers.1.engram.table.weight" in hf
    back = from_hf_state_dict(hf, model.args)
    assert back.keys() == sd.keys()
    assert all(back[k] is sd[k] for k in sd)
    with pytest.raises(KeyError, match="unknown Hugging Face parameter"):
        from_hf_state_dict({"model.layers.0.self_attn.qkv.weight": torch.zeros(1)}, model.args)


def test_hf_tied_embeddings() -> None:
    args = get_model_args("llama3", "debug").replace(vocab_size=VOCAB, tie_embeddings=True)
    from engram.models.transformer import Transformer

    model = Transformer(args)
    assert model.output.weight is model.tok_embeddings.weight
    hf = to_hf_state_dict(model.state_dict(), args)
    assert "lm_head.weight" not in hf
    back = from_hf_state_dict({**hf, "lm_head.weight": torch.zeros(1)}, args)
    model.load_state_dict(back)  # strict: the tied head is tok_embeddings.weight
    assert set(model.state_dict()) == set(back)  # one matrix, one entry (checkpoints too)
    assert "output.weight" not in back
