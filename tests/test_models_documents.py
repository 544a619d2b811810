"""Packed documents kept apart (model.attn_mask_type = "block_causal", engram/models/documents.py).

- A sequence packing 3 documents gives every token the logits (and loss) it gets when its
  document runs alone: attention, the Engram ShortConv and RoPE (positions reset) stay within
  documents. Alone at its packed (global) positions it gets the same too: RoPE is relative, so
  resetting positions is a choice of rounding, not of math.
- The default (causal) model ignores segment ids bit for bit; the flex block mask computes what
  the SDPA bool mask does (forward; torch has no CPU flex backward, refused with the fix).
- The rule behind both masks, the ShortConv's taps, and the config's refusals.
Multi-process layouts (TP, PP, CP, FSDP): tests/test_parallelisms_documents.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engram.config import ConfigError, config_from_dict
from engram.config import Engram as EngramConfig
from engram.config import Model as ModelConfig
from engram.models import build_model
from engram.models.documents import document_mask, document_starts
from engram.models.engram import ShortConv

torch.set_num_threads(2)

VOCAB = 300
ROWS = {1: 401, 3: 397}
LENGTHS = [(7, 5, 9), (12, 9)]  # documents packed into each of two rows (21 tokens)


def _engram() -> EngramConfig:
    return EngramConfig(
        layer_ids=[1, 3],
        n_head_per_ngram=4,
        vocab_size_per_ngram=[50, 60],
        n_embed_per_ngram=32,
        init="paper",  # every Engram parameter (the ShortConv's too) acts from step 0
        respect_doc_boundaries=True,
    )


def _model(name: str = "llama3", **model_kw):
    cfg = ModelConfig(name=name, attn_mask_type="block_causal", **model_kw)
    model = build_model(cfg, _engram(), VOCAB, ROWS, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def _packed(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS[0])
    x = torch.randint(0, VOCAB, (2, t), generator=g)
    hash_ids = torch.randint(0, 397, (2, t, 2, 8), generator=g)
    seg = torch.stack(
        [torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in LENGTHS]
    )
    return x, hash_ids, seg


def _alone(model, x, hash_ids, global_positions: bool):
    """Every document of every row through the model on its own -> logits like the packed."""
    out = torch.empty(*x.shape, VOCAB)
    for r, row in enumerate(LENGTHS):
        s = 0
        for n in row:
            pos = torch.arange(s, s + n)[None] if global_positions else None
            out[r, s : s + n] = model(
                x[r : r + 1, s : s + n], hash_ids=hash_ids[r : r + 1, s : s + n], positions=pos
            )[0]
            s += n
    return out


def test_packed_documents_equal_each_document_alone():
    """Measured: logits within 5e-7 absolute, per-token losses within 5e-7 (fp32)."""
    model = _model("qwen3")  # q / k norms before RoPE too
    x, hash_ids, seg = _packed()
    packed = model(x, hash_ids=hash_ids, segment_ids=seg)
    alone = _alone(model, x, hash_ids, global_positions=False)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    labels = torch.randint(0, VOCAB, x.shape, generator=torch.Generator().manual_seed(5))
    per_token = [F.cross_entropy(z.flatten(0, 1), labels.flatten(), reduction="none")
                 for z in (packed, alone)]  # fmt: skip
    torch.testing.assert_close(per_token[0], per_token[1], rtol=1e-5, atol=1e-5)
    # Without the mask the later documents see the earlier ones: the test can fail.
    crossed = model(x, hash_ids=hash_ids)
    assert (crossed - alone)[:, 7:].abs().max() > 1e-2


def test_reset_positions_equal_global_positions():
    """The packed model restarts RoPE at 0 per document; a document alone at its packed positions
    (what global positions would give) computes the same: RoPE scores depend on q - k only.
    Measured: logits within 6.9e-7."""
    model = _model()
    x, hash_ids, seg = _packed(seed=1)
    packed = model(x, hash_ids=hash_ids, segment_ids=seg)
    torch.testing.assert_close(
        packed, _alone(model, x, hash_ids, global_positions=True), rtol=1e-5, atol=1e-5
    )


def test_causal_model_ignores_segment_ids_bit_for_bit():
    cfg = ModelConfig(name="llama3")  # attn_mask_type = causal: the pretraining default
    model = build_model(cfg, _engram(), VOCAB, ROWS, device="cpu")
    model.init_weights(seed=0)
    x, hash_ids, seg = _packed()
    assert torch.equal(model(x, hash_ids=hash_ids, segment_ids=seg), model(x, hash_ids=hash_ids))


def test_one_document_equals_the_causal_model():
    """segment_ids of one document: the block-causal path (mask, taps) computes the causal one."""
    model = _model()
    x, hash_ids, _ = _packed()
    one = torch.zeros_like(x)
    torch.testing.assert_close(
        model(x, hash_ids=hash_ids, segment_ids=one), model(x, hash_ids=hash_ids),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip


def test_flex_block_mask_equals_the_sdpa_mask():
    """Eager FlexAttention on CPU (forward only: torch has no CPU flex backward); measured: logits
    within 3.6e-7 of SDPA's. The CUDA path compiles flex_attention and create_block_mask; no GPU
    here, so that path is untested."""
    sdpa, flex = _model(), _model(attn_backend="flex")
    x, hash_ids, seg = _packed(seed=2)
    with torch.no_grad():
        want = sdpa(x, hash_ids=hash_ids, segment_ids=seg)
        with pytest.warns(UserWarning, match="without torch.compile"):
            got = flex(x, hash_ids=hash_ids, segment_ids=seg)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no backward on CPU.*attn_backend = 'sdpa'"):
        flex(x, hash_ids=hash_ids, segment_ids=seg)


def test_mask_rule_and_document_starts():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 7, 7, 5, 5]])
    # A document is a run of equal ids: the second row's last run is a new document.
    assert document_starts(seg).tolist() == [[0, 0, 0, 3, 3, 5], [0, 0, 2, 2, 4, 4]]
    pos = torch.arange(6)
    mask = document_mask(pos, document_starts(seg), pos, "sdpa")[:, 0]
    assert mask.shape == (2, 6, 6)
    want = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                         [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]])  # fmt: skip
    assert torch.equal(mask[0], want.bool())
    # Queries held as chunks (context parallelism): rows of the whole mask, keys as gathered.
    q, k = torch.tensor([1, 4]), torch.tensor([3, 4, 5, 0, 1, 2])
    part = document_mask(q, document_starts(seg)[:, q], k, "sdpa")[:, 0]
    assert torch.equal(part, mask[:, q][:, :, k])


def test_short_conv_taps_stop_at_document_starts():
    """Tap by tap (document_conv) with no boundary = the conv; a token's output does not move
    when an earlier document changes."""
    torch.manual_seed(0)
    conv = ShortConv(dim=8, kernel_size=4, dilation=3, hc_mult=1)
    torch.nn.init.normal_(conv.conv.weight)
    x = torch.randn(2, 20, 1, 8)
    pos = torch.arange(20).expand(2, 20)
    torch.testing.assert_close(conv(x, None, pos), conv(x), rtol=1e-5, atol=1e-6)
    starts = torch.tensor([0] * 6 + [6] * 14).expand(2, 20)  # a document starts at 6
    y = conv(x, None, pos - starts)
    x2 = x.clone()
    x2[:, :6] = torch.randn(2, 6, 1, 8)
    torch.testing.assert_close(conv(x2, None, pos - starts)[:, 6:], y[:, 6:], rtol=0, atol=0)
    assert not torch.allclose(conv(x2)[:, 6:], conv(x)[:, 6:])  # the plain conv does reach
    torch.testing.assert_close(conv(x[:, 6:]), y[:, 6:], rtol=1e-5, atol=1e-6)


def test_bad_settings_and_inputs_name_the_fix():
    with pytest.raises(ConfigError, match="respect_doc_boundaries = true"):
        config_from_dict({"model": {"attn_mask_type": "block_causal"}})
    config_from_dict(
        {"model": {"attn_mask_type": "block_causal"}, "engram": {"respect_doc_boundaries": True}}
    )
    config_from_dict({"model": {"attn_mask_type": "block_causal"}, "engram": {"enabled": False}})
    with pytest.raises(ConfigError, match="attn_backend = 'flex' is for attn_mask_type"):
        config_from_dict({"model": {"attn_backend": "flex"}})
    with pytest.raises(ConfigError, match="attn_mask_type must be one of causal, block_causal"):
        config_from_dict({"model": {"attn_mask_type": "document"}})
    model = _model()
    x, hash_ids, seg = _packed()
    with pytest.raises(ValueError, match="whole sequence"):
        model(x, hash_ids=hash_ids, segment_ids=seg[:, :5])
