"""Tokenizer, document sources, packing and the stateful loader (engram/data/)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
from launcher import run_distributed
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from engram.config import config_from_dict
from engram.data.datasets import (
    ShuffledDocuments,
    build_documents,
    read_jsonl_documents,
    read_text_documents,
    split_documents,
)
from engram.data.loader import StreamSource, build_dataloader
from engram.data.synthetic import ATTRIBUTES, TEMPLATES, FactBase, SyntheticFacts
from engram.data.tokenizer import DEBUG_TOKENIZER, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TOK = load_tokenizer("")


class StandInHasher:
    """Cheap deterministic stand-in with the NgramHasher call signature ([B,T] -> [B,T,L,H])."""

    def __call__(self, input_ids: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
        out = input_ids[:, :, None, None] * np.array([[1, 3, 7]], dtype=np.int64)
        if segment_ids is not None:
            out = out + 1000 * segment_ids[:, :, None, None]
        return out


def _cfg(seq_len=16, batch=2, workers=0, **sections):
    raw = {
        "training": {"seq_len": seq_len, "local_batch_size": batch},
        "data": {"num_workers": workers, "synthetic_num_entities": 64},
        "engram": {"vocab_size_per_ngram": [1009, 1013], "n_head_per_ngram": 2},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype
            assert np.array_equal(x[k].numpy(), y[k].numpy()), k


# ------------------------------------------------------------------------------- tokenizer


def test_debug_tokenizer_exists_and_round_trips():
    assert DEBUG_TOKENIZER.is_file() and DEBUG_TOKENIZER.stat().st_size < 300_000
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (
        TOK.hf.token_to_id("<|pad|>"),
        TOK.hf.token_to_id("<|bos|>"),
        TOK.hf.token_to_id("<|eos|>"),
    )
    assert len({TOK.pad_id, TOK.bos_id, TOK.eos_id}) == 3
    assert TOK.vocab_size == TOK.hf.get_vocab_size(with_added_tokens=True) == 2048
    texts = [
        SyntheticFacts(7, 16, 0, "train")[3],
        "The Café on  Zürich's\tcorner.\n\nNAÏVE 2024 résumé — ok?",
        "  leading spaces, UPPER and lower\n",
    ]
    for text in texts:
        ids = TOK.encode(text)
        assert all(0 <= i < TOK.vocab_size for i in ids)
        assert TOK.eos_id not in ids  # no special tokens added by encode
        assert TOK.decode(ids) == text
        assert TOK.decode(np.array(ids)) == text
    # BPE learned merges for the fact vocabulary: far fewer tokens than bytes.
    assert len(TOK.encode(texts[0])) < len(texts[0].encode()) / 3


def test_debug_tokenizer_regenerates_identically():
    spec = importlib.util.spec_from_file_location(
        "make_debug_tokenizer", ROOT / "scripts" / "make_debug_tokenizer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = json.loads(module.build_debug_tokenizer().to_str())
    shipped = json.loads(DEBUG_TOKENIZER.read_text(encoding="utf-8"))
    assert fresh["model"]["vocab"] == shipped["model"]["vocab"]
    assert fresh["model"]["merges"] == shipped["model"]["merges"]
    assert fresh["added_tokens"] == shipped["added_tokens"]
    config = DEBUG_TOKENIZER.parent / "tokenizer_config.json"  # special tokens + chat template
    assert json.loads(config.read_text(encoding="utf-8")) == module.tokenizer_config()


def _save_tokenizer(path: Path, specials: list[str]) -> Path:
    vocab = {t: i for i, t in enumerate(specials + list("abc "))}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token=specials[0] if specials else None))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(specials)
    tok.save(str(path))
    return path


def test_tokenizer_special_ids(tmp_path):
    llama = _save_tokenizer(tmp_path / "llama.json", ["<|begin_of_text|>", "<|end_of_text|>"])
    tok = load_tokenizer(llama)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)  # no pad token: pad = eos
    (tmp_path / "folder").mkdir()
    _save_tokenizer(tmp_path / "folder" / "tokenizer.json", ["<unk>", "<s>", "</s>", "<pad>"])
    tok = load_tokenizer(tmp_path / "folder")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert tok.vocab_size == 8
    qwen = _save_tokenizer(tmp_path / "qwen.json", ["<|endoftext|>", "<|im_end|>"])
    tok = load_tokenizer(qwen)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, 0, 0)
    no_eos = _save_tokenizer(tmp_path / "no_eos.json", ["<unk>", "<s>"])
    with pytest.raises(ValueError, match="end-of-document tokens"):
        load_tokenizer(no_eos)
    with pytest.raises(FileNotFoundError, match="model.tokenizer_path"):
        load_tokenizer(tmp_path / "missing.json")


# ------------------------------------------------------------------------------- documents


def test_synthetic_facts_deterministic_and_splits_share_facts():
    a, b = SyntheticFacts(5, 40, 0, "train"), SyntheticFacts(5, 40, 0, "train")
    assert [a[i] for i in (0, 1, 99)] == [b[i] for i in (0, 1, 99)]
    assert a[1] != a[2]
    assert SyntheticFacts(5, 40, 1, "train")[0] != a[0]  # the stream seed reorders documents
    base = FactBase.generate(5, 40)
    assert len(set(base.entities)) == 40
    assert base.entities != FactBase.generate(6, 40).entities
    # Every sentence of either split is a true statement of the same fact base.
    truths = {
        t.format(e=e, v=facts[attr])
        for e, facts in zip(base.entities, base.facts, strict=True)
        for attr in ATTRIBUTES
        for t in TEMPLATES[attr]
    }
    val = SyntheticFacts(5, 40, 0, "val")
    train_docs = {a[i] for i in range(300)}
    val_docs = [val[i] for i in range(300)]
    assert not train_docs & set(val_docs)  # different documents
    for doc in list(train_docs)[:50] + val_docs[:50]:
        sentences = re.split(r"(?<=\.) ", doc)
        assert sentences and all(s in truths for s in sentences), doc
    with pytest.raises(ValueError, match="valid splits"):
        SyntheticFacts(5, 40, 0, "test")


def test_text_folder_loading_and_epochs(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("first doc\nline two\n\n  \nsecond doc\n\n\n\nthird", "utf-8")
    (tmp_path / "sub" / "b.txt").write_text("\n\nfourth doc\n", "utf-8")
    (tmp_path / "ignored.md").write_text("not a txt file", "utf-8")
    docs = read_text_documents(tmp_path)
    assert docs == ["first doc\nline two", "second doc", "third", "fourth doc"]
    assert read_text_documents(tmp_path / "sub" / "b.txt") == ["fourth doc"]
    stream = ShuffledDocuments(docs, seed=3)
    for epoch in range(3):
        assert sorted(stream[epoch * 4 + i] for i in range(4)) == sorted(docs)
    assert [stream[i] for i in range(8)] == [ShuffledDocuments(docs, 3)[i] for i in range(8)]
    train, val = split_documents(docs, "train"), split_documents(docs, "val")
    assert len(val) == 1 and sorted(train + val) == sorted(docs)
    cfg = _cfg(data={"dataset": "text", "path": str(tmp_path)})
    assert build_documents(cfg.data, "val", 0)[5] == val[0]
    with pytest.raises(FileNotFoundError, match="data.path"):
        read_text_documents(tmp_path / "nope")
    with pytest.raises(ValueError, match="eval_batches"):
        split_documents(["only one"], "val")


def test_jsonl_loading_and_missing_field_error(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n', "utf-8")
    assert read_jsonl_documents(good) == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"text": "two"}\n{"content": "three"}\n', "utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: no 'text' field"):
        read_jsonl_documents(bad)
    bad.write_text('{"text": "one"}\n{"text": \n', "utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        read_jsonl_documents(bad)


# ------------------------------------------------------------------------------- packing


def _naive_samples(docs, seq_len, n):
    """Reference: concatenate doc + eos, cut into seq_len + 1 chunks, count eos for segments."""
    stream: list[int] = []
    i = 0
    while len(stream) < n * (seq_len + 1):
        stream += TOK.encode(docs[i]) + [TOK.eos_id]
        i += 1
    out = []
    for k in range(n):
        x = stream[k * (seq_len + 1) : (k + 1) * (seq_len + 1)]
        seg, segs = 0, []
        for tok in x[:-1]:
            segs.append(seg)
            if tok == TOK.eos_id:
                seg += 1
        out.append((x[:-1], x[1:], segs))
    return out


@pytest.mark.parametrize("seq_len", [7, 64, 300])
def test_packing_matches_naive_reference(seq_len):
    docs = SyntheticFacts(1, 32, 0, "train")
    source = StreamSource(docs, TOK.encode, TOK.eos_id, seq_len, "fp")
    reader = source.reader(source.start())
    got = reader.read(0, 5) + reader.read(6, 1)
    got[5:5] = source.reader(source.start()).read(5, 1)  # a fresh reader skips to sample 5
    got += reader.read(7, 5)
    for sample, (inputs, labels, segs) in zip(got, _naive_samples(docs, seq_len, 12), strict=True):
        assert sample["input_ids"].dtype == np.int64
        assert sample["input_ids"].tolist() == inputs
        assert sample["labels"].tolist() == labels
        assert sample["segment_ids"].tolist() == segs
    assert any(s["segment_ids"].max() > 0 for s in got)


# ------------------------------------------------------------------------------- loader


@pytest.mark.parametrize("respect", [False, True])
def test_loader_batches_and_real_hash_ids(respect):
    from engram.hashing.ngram import NgramHasher

    cfg = _cfg(seq_len=32, batch=3, engram={"respect_doc_boundaries": respect})
    hasher = NgramHasher.from_config(cfg.engram, TOK.hf, TOK.vocab_size)
    batches = _take(build_dataloader(cfg, TOK, hasher, 0, 1), 3)
    for batch in batches:
        assert set(batch) == {"input_ids", "labels", "segment_ids", "hash_ids"}
        for k in ("input_ids", "labels", "segment_ids"):
            assert batch[k].shape == (3, 32) and str(batch[k].dtype) == "torch.int64"
        ids = batch["input_ids"].numpy()
        seg = batch["segment_ids"].numpy() if respect else None
        expected = hasher(ids.copy(), None if seg is None else seg.copy())
        assert batch["hash_ids"].shape == (3, 32, len(hasher.layer_ids), hasher.num_heads)
        assert str(batch["hash_ids"].dtype) == "torch.int64"
        assert np.array_equal(batch["hash_ids"].numpy(), expected)
        assert np.array_equal(ids[:, 1:], batch["labels"].numpy()[:, :-1])
    plain = _take(build_dataloader(cfg, TOK, None, 0, 1), 1)[0]
    assert "hash_ids" not in plain
    assert np.array_equal(plain["input_ids"].numpy(), batches[0]["input_ids"].numpy())


def test_val_split_differs_from_train():
    cfg = _cfg()
    train = _take(build_dataloader(cfg, TOK, None, 0, 1, split="train"), 2)
    val = _take(build_dataloader(cfg, TOK, None, 0, 1, split="val"), 2)
    val2 = _take(build_dataloader(cfg, TOK, None, 0, 1, split="val"), 2)
    assert not np.array_equal(train[0]["input_ids"].numpy(), val[0]["input_ids"].numpy())
    _assert_batches_equal(val, val2)


@pytest.mark.parametrize("saved, loaded", [(0, 0), (2, 2), (0, 2), (2, 0), (2, 1)])
def test_resume_is_exact_at_any_num_workers(saved, loaded):
    """Stop mid-run at `saved` workers (the iterator alive, workers prefetching ahead) and
    resume at `loaded`: the batches, hash ids included, are those of an uninterrupted run at
    either worker count (the property for which this loader keeps its own state rather than
    torchdata's StatefulDataLoader, whose state is per worker count: docs/data.md)."""
    cfg = _cfg(seq_len=24, batch=2, workers=saved, engram={"respect_doc_boundaries": True})
    other = _cfg(seq_len=24, batch=2, workers=loaded, engram={"respect_doc_boundaries": True})
    k, m = 5, 4
    full = _take(build_dataloader(cfg, TOK, StandInHasher(), 0, 1), k + m)
    if loaded != saved:
        _assert_batches_equal(
            _take(build_dataloader(other, TOK, StandInHasher(), 0, 1), k + m), full
        )
    first = build_dataloader(cfg, TOK, StandInHasher(), 0, 1)
    it = iter(first)
    head = [next(it) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))  # plain, JSON-able
    del it, first
    resumed = build_dataloader(other, TOK, StandInHasher(), 0, 1)
    resumed.load_state_dict(state)
    tail = _take(resumed, m)
    _assert_batches_equal(head + tail, full)
    assert resumed.state_dict()["batches"] == k + m


def test_read_ahead_keeps_the_state_of_completed_steps():
    """The training loop reads step N+1's micro-batches while step N runs (runner/loop.py
    ReadAhead): the loader state a checkpoint saves after step N equals the state of a loader
    that read only steps 1..N (no read-ahead), and resuming from it gives the batches of an
    uninterrupted run."""
    import torch

    from runner.loop import ReadAhead

    cfg, n, steps, cpu = _cfg(seq_len=24, batch=2), 2, 5, torch.device("cpu")
    full = _take(build_dataloader(cfg, TOK, StandInHasher(), 0, 1), n * steps)
    loader = build_dataloader(cfg, TOK, StandInHasher(), 0, 1)
    data, states = ReadAhead(loader, n, cpu, last_step=steps), {}
    for step in range(1, steps + 1):
        batches, ahead = data.take(step)
        _assert_batches_equal(batches, full[n * (step - 1) : n * step])
        if step < steps:
            _assert_batches_equal(ahead, full[n * step : n * (step + 1)])
        else:
            assert ahead is None  # nothing read past the last step
        plain = build_dataloader(cfg, TOK, StandInHasher(), 0, 1)
        _take(plain, n * step)
        states[step] = json.loads(json.dumps(loader.state_dict()))
        assert states[step] == plain.state_dict(), step
    resumed = build_dataloader(cfg, TOK, StandInHasher(), 0, 1)
    resumed.load_state_dict(states[3])
    data = ReadAhead(resumed, n, cpu, last_step=steps)
    tail = [b for step in (4, 5) for b in data.take(step)[0]]
    _assert_batches_equal(tail, full[n * 3 :])


def test_resume_rejects_changed_data_or_shape():
    state = _take_state(_cfg(seq_len=16), 2)
    for cfg, needle in [
        (_cfg(seq_len=32), "training.seq_len"),
        (_cfg(data={"synthetic_seed": 9}), "fingerprint"),
        (_cfg(job={"seed": 3}), "seed"),
    ]:
        with pytest.raises(ValueError, match=needle):
            build_dataloader(cfg, TOK, None, 0, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="engram-loader/1"):
        build_dataloader(_cfg(), TOK, None, 0, 1).load_state_dict({"sample": 3})


def _take_state(cfg, n, rank=0, world=1):
    loader = build_dataloader(cfg, TOK, None, rank, world)
    _take(loader, n)
    return json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("world,workers", [(2, 0), (4, 0), (2, 2)])
def test_global_batch_is_union_of_rank_slices(world, workers):
    b, steps = 2, 5
    single = _take(build_dataloader(_cfg(batch=world * b), TOK, StandInHasher(), 0, 1), steps)
    for rank in range(world):
        mine = _take(
            build_dataloader(_cfg(batch=b, workers=workers), TOK, StandInHasher(), rank, world),
            steps,
        )
        for step in range(steps):
            for key in single[step]:
                assert np.array_equal(
                    mine[step][key].numpy(), single[step][key][rank * b : (rank + 1) * b].numpy()
                ), (rank, step, key)


def _rank_batches(rank, world, cfg, steps):
    loader = build_dataloader(cfg, load_tokenizer(""), StandInHasher(), rank, world)
    return [batch["input_ids"].numpy() for batch in _take(loader, steps)]


def test_loader_in_forked_ranks():
    cfg = _cfg(batch=2)
    per_rank = run_distributed(_rank_batches, 2, cfg, 3)
    single = _take(build_dataloader(_cfg(batch=4), TOK, None, 0, 1), 3)
    for step in range(3):
        assert np.array_equal(
            np.concatenate([r[step] for r in per_rank]), single[step]["input_ids"]
        )


def _child_batches(cfg, steps, queue):
    queue.put(_rank_batches(1, 2, cfg, steps))


def test_loader_with_workers_in_forked_child():
    # tests/launcher.py ranks are daemonic and may not start loader workers; a plain forked
    # (non-daemonic) process, as torchrun gives, can.
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_batches, args=(_cfg(batch=2, workers=2), 3, queue))
    proc.start()
    got = queue.get(timeout=120)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    single = _take(build_dataloader(_cfg(batch=4), TOK, None, 0, 1), 3)
    for step in range(3):
        assert np.array_equal(got[step], single[step]["input_ids"][2:4].numpy())
