"""Fine-tuning sequences and their loader (engram/data/sft.py, chat_dataset.py, sft_shards.py,
prepare_sft.py, synthetic_chat.py): labels and segment ids of packed / padded rows, overflow,
resume at another dp size, prepared shards equal to on-the-fly, the synthetic QA set, and the
export keeping the chat template."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from chat_fixtures import CONVERSATION, write_tokenizer_folder

from engram.config import ConfigError, config_from_dict
from engram.data.chat_dataset import build_chat_samples
from engram.data.chat_encode import ChatEncoder
from engram.data.chat_records import parse_record
from engram.data.chat_template import load_chat_template
from engram.data.loader import build_dataloader
from engram.data.prepare_sft import ChatOptions, prepare_chat
from engram.data.sft import IGNORE, ConversationArrays, SftSamples
from engram.data.synthetic import SyntheticFacts, entity_parts
from engram.data.synthetic_chat import qa_pairs, synthetic_chat_records
from engram.data.tokenizer import load_tokenizer

TOK = load_tokenizer("")


def _cfg(seq_len=128, batch=4, **data):
    raw = {
        "training": {"seq_len": seq_len, "local_batch_size": batch},
        "data": {"dataset": "chat", "synthetic_num_entities": 16, **data},
        "engram": {"vocab_size_per_ngram": [1009, 1013], "n_head_per_ngram": 2},
    }
    return config_from_dict(raw)


def _records(n: int, seed: int = 0) -> list[dict]:
    """Conversations of very unequal lengths and target counts (1-3 turns, short / long)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for t in range(int(rng.integers(1, 4))):
            msgs.append({"role": "user", "content": f"Q{i}.{t}?"})
            answer = " ".join(["Drusa"] * int(rng.integers(1, 9)))
            msgs.append({"role": "assistant", "content": answer})
        out.append({"messages": msgs})
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _encoded(rows: list[dict]) -> ConversationArrays:
    enc = ChatEncoder(TOK, load_chat_template(TOK))
    pairs = [enc.encode(parse_record(r, f"r{i}")) for i, r in enumerate(rows)]
    return ConversationArrays(
        [p[0] for p in pairs], [p[1] for p in pairs], [f"r{i}" for i in range(len(rows))], "fp"
    )


def _samples(table, seq_len=128, **kw) -> SftSamples:
    opts = {"pack": True, "overflow": "truncate", "train_on": "assistant", "seed": 0}
    opts.update(kw)
    return SftSamples(
        table, np.arange(len(table.lengths)), seq_len, split="train", pad_id=TOK.pad_id, **opts
    )


# ------------------------------------------------------------------------------ rows


@pytest.mark.parametrize("pack", [True, False])
def test_rows_hold_whole_conversations_with_exact_targets(pack):
    table = _encoded(_records(40))
    s = _samples(table, pack=pack)
    seen: dict[int, int] = {}
    for r in range(s.rows):
        row = s.row(r)
        x, labels, seg = row["input_ids"], row["labels"], row["segment_ids"]
        assert x.dtype == labels.dtype == seg.dtype == np.int64 and x.shape == (128,)
        assert (np.diff(seg) >= 0).all() and seg[0] == 0  # 0..k, non-decreasing
        convs = s.conv[s.bounds[r] : s.bounds[r + 1]].tolist()
        assert pack or len(convs) == 1
        at = 0
        for k, c in enumerate(convs):
            n = int(s.length[s.bounds[r] + k])  # truncated ones: their first T + 1 tokens
            ids, mask = table.read(c, n)
            m = min(n, 128 - at)  # input_ids hold T of the row's T + 1 tokens
            assert (x[at : at + m] == ids[:m]).all() and (seg[at : at + m] == k).all()
            # label t predicts token t + 1 of the same conversation when that token is a target
            want = np.where(mask[1:], ids[1:], IGNORE)
            got = labels[at : at + min(n - 1, 128 - at)]
            assert (got == want[: len(got)]).all()
            if at + n - 1 < 128:  # the last token never predicts the next one / padding
                assert labels[at + n - 1] == IGNORE
            seen[c] = seen.get(c, 0) + 1
            at += n
        assert (seg[at:] == len(convs)).all()  # padding: its own final segment
        assert (labels[at:] == IGNORE).all() and (x[at:] == TOK.pad_id).all()
    assert sorted(seen) == list(range(40)) and set(seen.values()) == {1}


def test_train_on_all_targets_every_token_of_its_conversation():
    table = _encoded(_records(10))
    row = _samples(table, seq_len=256, train_on="all", pack=False).row(0)
    n = int((row["segment_ids"] == 0).sum())
    assert (row["labels"][: n - 1] == row["input_ids"][1:n]).all()
    assert (row["labels"][n - 1 :] == IGNORE).all()


def test_overflow_truncate_drop_error_are_counted_and_logged(caplog):
    table = _encoded(_records(30))
    long = int((table.lengths > 65).sum())
    assert 0 < long < 30
    with caplog.at_level(logging.INFO, logger="engram"):
        s = _samples(table, seq_len=64, overflow="truncate")
    assert s.report["truncated"] + s.report["dropped"] == long
    assert s.report["conversations"] == 30 - s.report["dropped"]
    assert f"{s.report['truncated']} truncated to seq_len + 1 (first: r" in caplog.text
    assert int(s.length.max()) == 65
    d = _samples(table, seq_len=64, overflow="drop")
    assert d.report["dropped"] == long and d.report["conversations"] == 30 - long
    with pytest.raises(
        ValueError,
        match=rf"{long} conversation\(s\) longer than .* = 65 tokens \(first: r\d+.*data\.overflow",
    ):
        _samples(table, seq_len=64, overflow="error")
    with pytest.raises(ValueError, match="no conversation is left to train on.*dropped"):
        _samples(table, seq_len=4, overflow="drop")


def test_rows_are_a_function_of_the_sample_index():
    s = _samples(_encoded(_records(40)))
    a = s.samples(0, 2 * s.rows + 3)
    assert sorted(s.row_of(np.arange(s.rows)).tolist()) == list(range(s.rows))  # an epoch
    b = s.samples(5, 4)
    for x, y in zip(a[5:9], b, strict=True):
        assert all((x[k] == y[k]).all() for k in x)
    assert s.row_of(np.arange(s.rows, 2 * s.rows)).tolist() != s.row_of(np.arange(s.rows)).tolist()


# --------------------------------------------------------------------------- loader


def _batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_loader_resumes_the_conversation_stream_at_any_dp_size(tmp_path):
    path = _write_jsonl(tmp_path / "sft" / "a.jsonl", _records(120))
    cfg = _cfg(path=str(path.parent), batch=2)
    full = _batches(build_dataloader(cfg, TOK, None, 0, 1, "train"), 4)  # global batch 2
    ranks = [
        build_dataloader(_cfg(path=str(path.parent), batch=1), TOK, None, r, 2) for r in (0, 1)
    ]
    parts = [_batches(dl, 4) for dl in ranks]
    for k in range(4):  # dp 2 x 1 row = the global batch of dp 1 x 2 rows
        for key in ("input_ids", "labels", "segment_ids"):
            joined = np.concatenate([parts[0][k][key].numpy(), parts[1][k][key].numpy()])
            assert (joined == full[k][key].numpy()).all()
    state = json.loads(json.dumps(ranks[0].state_dict()))  # plain JSON, global
    assert state == ranks[1].state_dict() and state["position"] == {"sample": 8}
    resumed = build_dataloader(cfg, TOK, None, 0, 1)
    resumed.load_state_dict(state)
    more = _batches(resumed, 2)
    again = _batches(build_dataloader(cfg, TOK, None, 0, 1), 6)[4:]
    for x, y in zip(more, again, strict=True):
        assert all((x[k] == y[k]).all() for k in x)
    other = _cfg(path=str(path.parent), batch=2, train_on="all")
    with pytest.raises(ValueError, match="fingerprint"):
        build_dataloader(other, TOK, None, 0, 1).load_state_dict(state)


def test_chat_hash_ids_stop_at_conversation_boundaries(tmp_path):
    class Hasher:
        def __call__(self, ids, seg=None):
            return (ids * 7 + (0 if seg is None else 1000 * seg))[:, :, None, None]

    path = _write_jsonl(tmp_path / "h" / "a.jsonl", _records(20))
    batch = _batches(build_dataloader(_cfg(path=str(path)), TOK, Hasher(), 0, 1), 1)[0]
    seg = batch["segment_ids"].numpy()
    assert seg.max() > 0  # packed: several conversations a row
    want = Hasher()(batch["input_ids"].numpy(), seg)
    assert (batch["hash_ids"].numpy() == want).all()  # segments reach the hasher by default


def test_held_out_split_is_disjoint_and_cached(tmp_path, caplog):
    path = _write_jsonl(tmp_path / "v" / "a.jsonl", _records(300))
    cfg = _cfg(path=str(path))
    with caplog.at_level(logging.INFO, logger="engram"):
        train = build_chat_samples(cfg, TOK, "train")
        val = build_chat_samples(cfg, TOK, "val")
        assert build_chat_samples(cfg, TOK, "val") is val  # a fresh eval loader reuses it
    assert len(val.conv) == 3 and not set(val.conv.tolist()) & set(train.conv.tolist())
    assert caplog.text.count("(val): 3 conversations") == 1


def test_no_assistant_turns_are_skipped_counted_and_logged(tmp_path, caplog):
    rows = _records(20) + [{"messages": [{"role": "user", "content": "hello?"}]}]
    path = _write_jsonl(tmp_path / "s" / "a.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="engram"):
        s = build_chat_samples(_cfg(path=str(path)), TOK, "train")
    assert s.report["skipped"] == 1
    assert f"1 skipped without an assistant turn or text (first: {path}:21)" in caplog.text
    only = _write_jsonl(tmp_path / "e" / "a.jsonl", [rows[-1]] * 3)
    with pytest.raises(ValueError, match=r"no conversation is left.*3 skipped without"):
        build_chat_samples(_cfg(path=str(only)), TOK, "train")


# -------------------------------------------------------------------------- prepared


def test_prepared_shards_give_the_on_the_fly_batches(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = _records(150, seed=1) + [{"messages": [{"role": "user", "content": "unanswered"}]}]
    src = tmp_path / "src"
    _write_jsonl(src / "a.jsonl", rows[:80])
    src.mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows[80:]), src / "b.parquet", row_group_size=16)
    opts = ChatOptions(shard_bytes=2000)  # several shards, cut inside both files
    m = prepare_chat([str(src)], tmp_path / "prep1", opts, progress=False)
    assert len(m["shards"]) > 3 and m["num_conversations"] == 150 and m["skipped"] == 1
    prepare_chat([str(src)], tmp_path / "prep2", ChatOptions(shard_bytes=2000, workers=2), False)
    for f in sorted((tmp_path / "prep1").iterdir()):  # same bytes at any --workers
        if f.name != "dataset.json":
            assert f.read_bytes() == (tmp_path / "prep2" / f.name).read_bytes(), f.name
    for split in ("train", "val"):
        fly = _batches(build_dataloader(_cfg(path=str(src)), TOK, None, 0, 1, split), 5)
        prep = _batches(
            build_dataloader(_cfg(path=str(tmp_path / "prep1")), TOK, None, 0, 1, split), 5
        )
        for x, y in zip(fly, prep, strict=True):
            assert all((x[k] == y[k]).all() for k in x), split
    with pytest.raises(ValueError, match=r'format .engram-sft/1.*data\.dataset = "chat"'):
        build_dataloader(
            config_from_dict({"data": {"dataset": "tokens", "path": str(tmp_path / "prep1")}}),
            TOK,
            None,
            0,
            1,
        )


def test_prepared_rank_reads_only_the_conversations_of_its_rows(tmp_path, monkeypatch):
    """O(local batch): at dp 64 a rank reads the conversations of its b rows, nothing else."""
    from engram.data.sft_shards import SftShards

    src = _write_jsonl(tmp_path / "src" / "a.jsonl", _records(400))
    prepare_chat([str(src)], tmp_path / "p", ChatOptions(), progress=False)
    reads = []
    real = SftShards.read
    monkeypatch.setattr(SftShards, "read", lambda self, i, n: reads.append(i) or real(self, i, n))
    loader = build_dataloader(_cfg(path=str(tmp_path / "p"), batch=2), TOK, None, 63, 64)
    reads.clear()  # the plan's start-up checks (truncated conversations) are not per step
    batches = _batches(loader, 2)
    samples = build_chat_samples(_cfg(path=str(tmp_path / "p"), batch=2), TOK, "train")
    rows = samples.row_of(np.array([126, 127, 254, 255]))  # rank 63's global samples
    want = [
        c for r in rows.tolist() for c in samples.conv[samples.bounds[r] : samples.bounds[r + 1]]
    ]
    assert reads == want and len(batches) == 2


def test_prepared_shards_refuse_another_template(tmp_path):
    src = _write_jsonl(tmp_path / "src" / "a.jsonl", _records(20))
    prepare_chat([str(src)], tmp_path / "p", ChatOptions(), progress=False)
    other = tmp_path / "other.jinja"
    other.write_text(load_chat_template(TOK).source.replace("\\n", "\\n\\n"))
    cfg = _cfg(path=str(tmp_path / "p"), chat_template=str(other))
    with pytest.raises(
        ValueError, match=r"rendered with the chat template .*tokenizer_config\.json"
    ):
        build_chat_samples(cfg, TOK, "train")


# --------------------------------------------------------------------- synthetic chat


def test_synthetic_parts_and_held_out_phrasings():
    pre, fine = entity_parts(1234, 64, 0.5)
    assert len(pre) == 32 and not set(pre) & set(fine) and sorted(pre + fine) == list(range(64))
    docs = SyntheticFacts(1234, 64, 0, "train", pre)
    names = SyntheticFacts(1234, 64, 0, "train").facts.entities
    text = " ".join(docs[i] for i in range(200))
    assert not any(f"{names[i]} " in text or f"{names[i]}." in text for i in fine)
    base = SyntheticFacts(1234, 64, 0, "train")  # part "all": the documents of before
    assert all(base[i] == SyntheticFacts(1234, 64, 0, "train", range(64))[i] for i in range(20))
    train = qa_pairs(1234, 64, "finetune", 0.5, "train")
    val = qa_pairs(1234, 64, "finetune", 0.5, "val")
    assert {q.entity for q in val} == {names[i] for i in fine}
    assert len(val) == 32 * 8 and len(train) == 2 * len(val)
    assert not {q.question for q in train} & {q.question for q in val}
    assert {(q.entity, q.attribute, q.answer) for q in train} == {
        (q.entity, q.attribute, q.answer) for q in val
    }
    convs = synthetic_chat_records(1234, 64, "finetune", 0.5, "train")
    turns = sum(len(c.messages) // 2 for c in convs)
    assert turns == len(train) and max(len(c.messages) for c in convs) == 6


def test_synthetic_chat_trains_through_the_loader():
    cfg = config_from_dict(
        {
            "training": {"seq_len": 64, "local_batch_size": 2},
            "data": {
                "dataset": "synthetic_chat",
                "synthetic_num_entities": 16,
                "synthetic_part": "finetune",
            },
        }
    )
    batch = _batches(build_dataloader(cfg, TOK, None, 0, 1), 1)[0]
    labels = batch["labels"].numpy()
    answers = TOK.decode(labels[labels != IGNORE].tolist())
    assert answers.count("<|eos|>") >= 2 and "?" not in answers  # answers only, no questions


# ------------------------------------------------------------------------- config / export


def test_chat_settings_are_refused_for_plain_datasets():
    with pytest.raises(
        ConfigError, match=r"data\.train_on, data\.pack set, but data\.dataset = 'jsonl'"
    ):
        config_from_dict(
            {"data": {"dataset": "jsonl", "path": "x", "train_on": "all", "pack": False}}
        )
    with pytest.raises(ConfigError, match="must be a JSON object"):
        config_from_dict({"data": {"dataset": "chat", "path": "x", "chat_template_kwargs": "[1]"}})
    with pytest.raises(ConfigError, match="not JSON"):
        config_from_dict({"data": {"dataset": "chat", "path": "x", "chat_template_kwargs": "{"}})
    with pytest.raises(ConfigError, match="synthetic_chat is generated"):
        config_from_dict({"data": {"dataset": "synthetic_chat", "path": "x"}})
    with pytest.raises(ConfigError, match="data.overflow must be"):
        config_from_dict({"data": {"dataset": "chat", "path": "x", "overflow": "wrap"}})
    with pytest.raises(ConfigError, match="synthetic_part"):
        config_from_dict({"data": {"dataset": "jsonl", "path": "x", "synthetic_part": "pretrain"}})


@pytest.mark.parametrize("style", ["llama3", "debug"])
def test_export_keeps_the_chat_template(tmp_path, style):
    transformers = pytest.importorskip("transformers")
    from engram.hf.export import _tokenizer_files

    tok = TOK if style == "debug" else load_tokenizer(write_tokenizer_folder(tmp_path / "t", style))
    out = tmp_path / "export"
    out.mkdir()
    _tokenizer_files(out, tok, 256, [])
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == load_chat_template(tok).source
    kwargs = {"date_string": "26 Jul 2024"}
    ours, _ = ChatEncoder(tok, load_chat_template(tok), kwargs).encode(
        parse_record({"messages": CONVERSATION}, "t")
    )
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert list(hf.apply_chat_template(CONVERSATION, return_dict=False, **kwargs)) == ours.tolist()
    generation = json.loads((out / "generation_config.json").read_text())
    if style == "llama3":  # bos_token as the template rendered it; stop at the end of a turn
        assert config["bos_token"] == "<|begin_of_text|>"
        assert generation["eos_token_id"] == [tok.eos_id, tok.hf.token_to_id("<|eot_id|>")]
    else:
        assert generation["eos_token_id"] == tok.eos_id


def test_prepare_data_script_chat_mode(tmp_path, capsys):
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location(
        "prepare_data", root / "scripts" / "prepare_data.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    src = _write_jsonl(tmp_path / "src" / "a.jsonl", _records(30))
    module.main(["--chat", "--input", str(src), "--out", str(tmp_path / "out"), "--quiet"])
    assert "30 conversations" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "dataset.json").read_text())["format"] == "engram-sft/1"
    bad = tmp_path / "bad" / "b.jsonl"
    _write_jsonl(bad, _records(30))
    with bad.open("a") as f:
        f.write('{"messages": [{"role": "robot", "content": "x"}]}\n')
    args = [
        "--chat",
        "--input",
        str(bad),
        "--out",
        str(tmp_path / "o2"),
        "--quiet",
        "--shard-mb",
        "0.001",
    ]
    with pytest.raises(
        ValueError, match=r"b\.jsonl \(byte \d+\): messages\[0\] has the unknown role 'robot'"
    ):
        module.main(args)
    assert not list((tmp_path / "o2").glob("*.tmp"))  # no partial shard left behind
