"""The Engram block against a transcription of DeepSeek's official demo (engram_demo_v1.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from engram.config import Engram as EngramConfig
from engram.config import Model as ModelConfig
from engram.models import build_model
from engram.models.engram import EngramBlock

torch.set_num_threads(2)

# ----------------------------------------------------------------------------- demo transcription
# ShortConv / MultiHeadEmbedding / Engram.forward as in the official demo, with the demo's
# globals (backbone hidden size, hc_mult, engram config) turned into arguments and the hashing
# replaced by given per-head ids.


class RefShortConv(nn.Module):
    def __init__(self, hidden_size, kernel_size=4, dilation=1, norm_eps=1e-5, hc_mult=4):
        super().__init__()
        self.hc_mult = hc_mult
        total_channels = hidden_size * hc_mult
        self.conv = nn.Conv1d(
            in_channels=total_channels,
            out_channels=total_channels,
            kernel_size=kernel_size,
            groups=total_channels,
            bias=False,
            padding=(kernel_size - 1) * dilation,
            dilation=dilation,
        )
        self.norms = nn.ModuleList([nn.RMSNorm(hidden_size, eps=norm_eps) for _ in range(hc_mult)])
        self.act_fn = nn.SiLU()

    def forward(self, x):
        B, T, G, C = x.shape
        normed_chunks = [self.norms[i](x[:, :, i, :]) for i in range(G)]
        x_norm = torch.cat(normed_chunks, dim=-1)
        y_bct = self.conv(x_norm.transpose(1, 2))[..., :T]
        y_bct = self.act_fn(y_bct)
        return y_bct.transpose(1, 2).view(B, T, G, C).contiguous()


class RefMultiHeadEmbedding(nn.Module):
    def __init__(self, list_of_N, D):
        super().__init__()
        offsets = [0]
        for n in list_of_N[:-1]:
            offsets.append(offsets[-1] + n)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long))
        self.embedding = nn.Embedding(num_embeddings=sum(list_of_N), embedding_dim=D)

    def forward(self, input_ids):
        return self.embedding(input_ids + self.offsets)


class RefEngram(nn.Module):
    def __init__(self, list_of_N, cfg: EngramConfig, hidden_size: int, hc_mult: int):
        super().__init__()
        self.hidden_size, self.hc_mult = hidden_size, hc_mult
        self.multi_head_embedding = RefMultiHeadEmbedding(
            list_of_N, cfg.n_embed_per_ngram // cfg.n_head_per_ngram
        )
        self.short_conv = RefShortConv(
            hidden_size, cfg.kernel_size, dilation=cfg.max_ngram, hc_mult=hc_mult
        )
        engram_hidden_size = (cfg.max_ngram - 1) * cfg.n_embed_per_ngram
        self.value_proj = nn.Linear(engram_hidden_size, hidden_size)
        self.key_projs = nn.ModuleList(
            [nn.Linear(engram_hidden_size, hidden_size) for _ in range(hc_mult)]
        )
        self.norm1 = nn.ModuleList([nn.RMSNorm(hidden_size) for _ in range(hc_mult)])
        self.norm2 = nn.ModuleList([nn.RMSNorm(hidden_size) for _ in range(hc_mult)])

    def forward(self, hidden_states, hash_input_ids):
        embeddings = self.multi_head_embedding(hash_input_ids).flatten(start_dim=-2)
        gates = []
        for hc_idx in range(self.hc_mult):
            key = self.key_projs[hc_idx](embeddings)
            normed_key = self.norm1[hc_idx](key)
            query = hidden_states[:, :, hc_idx, :]
            normed_query = self.norm2[hc_idx](query)
            gate = (normed_key * normed_query).sum(dim=-1) / math.sqrt(self.hidden_size)
            gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
            gate = gate.sigmoid().unsqueeze(-1)
            gates.append(gate)
        gates = torch.stack(gates, dim=2)
        value = gates * self.value_proj(embeddings).unsqueeze(2)
        return value + self.short_conv(value)


# ----------------------------------------------------------------------------- helpers

DIM = 32


def small_cfg(**kw) -> EngramConfig:
    base = dict(
        layer_ids=[1],
        max_ngram=3,
        n_head_per_ngram=4,
        vocab_size_per_ngram=[50, 60],
        n_embed_per_ngram=32,
        kernel_size=4,
    )
    base.update(kw)
    return EngramConfig(**base)


def head_sizes(cfg: EngramConfig) -> list[int]:
    # Any distinct per-head sizes do; the real ones are primes from engram/hashing/ngram.py.
    return [47 + 3 * j for j in range(cfg.num_heads)]


def randomise_(module: nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (norm weights too), so a wrong mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0))


def copy_into_block(ref: RefEngram, block: EngramBlock) -> None:
    with torch.no_grad():
        block.table.weight.copy_(ref.multi_head_embedding.embedding.weight)
        block.value_proj.weight.copy_(ref.value_proj.weight)
        block.value_proj.bias.copy_(ref.value_proj.bias)
        for m in range(ref.hc_mult):
            block.key_projs[m].weight.copy_(ref.key_projs[m].weight)
            block.key_projs[m].bias.copy_(ref.key_projs[m].bias)
            block.key_norms[m].weight.copy_(ref.norm1[m].weight)
            block.query_norms[m].weight.copy_(ref.norm2[m].weight)
            block.short_conv.norms[m].weight.copy_(ref.short_conv.norms[m].weight)
        block.short_conv.conv.weight.copy_(ref.short_conv.conv.weight)


def make_pair(hc_mult: int, seed: int = 0) -> tuple[RefEngram, EngramBlock, list[int]]:
    cfg = small_cfg(hc_mult=hc_mult, use_bias=True)
    sizes = head_sizes(cfg)
    ref = RefEngram(sizes, cfg, DIM, hc_mult)
    randomise_(ref, seed)
    block = EngramBlock(DIM, cfg, table_rows=sum(sizes))
    copy_into_block(ref, block)
    return ref, block, sizes


def per_head_ids(sizes: list[int], b: int, t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (b, t), generator=g) for n in sizes], dim=-1)


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(sizes[:-1]).cumsum(0).tolist()])


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("hc_mult", [1, 2])
def test_block_matches_demo(hc_mult: int) -> None:
    ref, block, sizes = make_pair(hc_mult)
    b, t = 3, 17
    ids = per_head_ids(sizes, b, t, seed=1)
    hidden = torch.randn(b, t, hc_mult, DIM, generator=torch.Generator().manual_seed(2))
    expected = ref(hidden, ids)
    got = block(hidden, ids + offsets(sizes))  # our ids carry the head offsets already
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if hc_mult == 1:  # the [B, T, D] form of a plain dense residual stream
        torch.testing.assert_close(block(hidden[:, :, 0], ids + offsets(sizes)), expected[:, :, 0])


def test_block_gradients_match_demo() -> None:
    ref, block, sizes = make_pair(2, seed=3)
    ids = per_head_ids(sizes, 2, 9, seed=4)
    hidden = torch.randn(2, 9, 2, DIM)
    h_ref, h_ours = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    (ref(h_ref, ids) ** 2).sum().backward()
    (block(h_ours, ids + offsets(sizes)) ** 2).sum().backward()
    torch.testing.assert_close(h_ours.grad, h_ref.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        block.table.weight.grad,
        ref.multi_head_embedding.embedding.weight.grad,
        rtol=1e-4,
        atol=1e-5,
    )
    torch.testing.assert_close(
        block.short_conv.conv.weight.grad, ref.short_conv.conv.weight.grad, rtol=1e-4, atol=1e-5
    )


def test_short_conv_is_causal() -> None:
    _, block, sizes = make_pair(1, seed=5)
    b, t, t0 = 2, 20, 11
    ids = per_head_ids(sizes, b, t, seed=6) + offsets(sizes)
    gen = torch.Generator().manual_seed(8)  # seeded: the same inputs on every run
    hidden = torch.randn(b, t, DIM, generator=gen)
    out = block(hidden, ids)
    hidden2, ids2 = hidden.clone(), ids.clone()
    hidden2[:, t0:] = torch.randn(b, t - t0, DIM, generator=gen)
    ids2[:, t0:] = per_head_ids(sizes, b, t - t0, seed=7) + offsets(sizes)
    out2 = block(hidden2, ids2)
    assert torch.equal(out[:, :t0], out2[:, :t0])
    assert not torch.allclose(out[:, t0:], out2[:, t0:])
    # ...and the conv does look back (dilation = max_ngram = 3, kernel 4: up to 9 steps).
    hidden3 = hidden.clone()
    hidden3[:, t0 - 9] += 1.0
    out3 = block(hidden3, ids)
    assert not torch.allclose(out[:, t0], out3[:, t0])
    assert torch.equal(out[:, : t0 - 9], out3[:, : t0 - 9])


def test_identity_init_outputs_zero() -> None:
    cfg = small_cfg(use_bias=True)
    block = EngramBlock(DIM, cfg, table_rows=500)
    block.init_weights(seed=0, prefix="layers.1.engram")
    ids = torch.randint(0, 500, (2, 10, cfg.num_heads))
    out = block(torch.randn(2, 10, DIM), ids)
    assert torch.equal(out, torch.zeros_like(out))
    paper = EngramBlock(DIM, small_cfg(init="paper"), table_rows=500)
    paper.init_weights(seed=0, prefix="layers.1.engram")
    assert paper(torch.randn(2, 10, DIM), ids).abs().max() > 0


def _model(init: str, enabled: bool = True, use_bias: bool = False):
    cfg = small_cfg(layer_ids=[0, 2], init=init, use_bias=use_bias, enabled=enabled)
    model = build_model(ModelConfig(name="qwen3"), cfg, 300, {0: 400, 2: 450}, device="cpu")
    model.init_weights(seed=7)
    return model, cfg


def _batch(cfg: EngramConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 300, (2, 16), generator=g)
    ids = torch.randint(0, 400, (2, 16, len(cfg.layer_ids), cfg.num_heads), generator=g)
    return x, ids


def test_identity_init_keeps_backbone_logits() -> None:
    with_engram, cfg = _model("identity")
    plain, _ = _model("identity", enabled=False)
    x, ids = _batch(cfg)
    # Same seed, same parameter names -> same backbone weights; Engram adds exactly 0.
    assert torch.equal(with_engram(x, hash_ids=ids), plain(x))


def _engram_params(model) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".engram." in n}


def test_identity_gradient_schedule() -> None:
    """With W_v = 0 the first backward reaches only value_proj (d out / d gate = 0, d out / d e =
    0, and the conv and its norms see RMSNorm(0) = 0); after one update every Engram parameter
    has a gradient. No init can do better while the output is exactly 0: that needs v = 0."""
    model, cfg = _model("identity", use_bias=True)
    x, ids = _batch(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x, hash_ids=ids).flatten(0, 1), x.flatten()).backward()
        for name, p in _engram_params(model).items():
            nonzero = p.grad is not None and p.grad.abs().sum().item() > 0
            first = name.split(".engram.")[1].startswith("value_proj")
            assert nonzero == (first or step == 1), (step, name)
        opt.step()


def test_paper_init_gradients_reach_everything() -> None:
    model, cfg = _model("paper", use_bias=True)
    x, ids = _batch(cfg)
    nn.functional.cross_entropy(model(x, hash_ids=ids).flatten(0, 1), x.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_engram_only_freezing() -> None:
    model, cfg = _model("identity")
    for name, p in model.named_parameters():
        p.requires_grad_(".engram." in name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x, ids = _batch(cfg, seed=step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x, hash_ids=ids).flatten(0, 1), x.flatten()).backward()
        opt.step()
    for name, p in model.named_parameters():
        if ".engram." in name:
            assert not torch.equal(p, before[name]), name
        else:
            assert torch.equal(p, before[name]), name


def test_block_rejects_bad_shapes() -> None:
    block = EngramBlock(DIM, small_cfg(), table_rows=100)
    with pytest.raises(ValueError, match="hash_ids"):
        block(torch.randn(2, 5, DIM), torch.zeros(2, 5, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden"):
        block(torch.randn(2, 5, DIM + 1), torch.zeros(2, 5, 8, dtype=torch.long))
