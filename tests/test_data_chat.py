"""Chat records and templates (engram/data/chat_records.py, chat_template.py, chat_encode.py):
rendered ids equal transformers' apply_chat_template, the target mask is each assistant turn's
content plus its end-of-turn token, and bad input is refused naming where and the fix."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from chat_fixtures import (
    CONVERSATION,
    STYLES,
    TOOL_CONVERSATION,
    TOOLS,
    template_text,
    write_tokenizer_folder,
)

from engram.data.chat_encode import ChatEncoder, NotPrefixStableError
from engram.data.chat_records import (
    Conversation,
    PlainText,
    RecordError,
    parse_record,
    read_records,
)
from engram.data.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from engram.data.tokenizer import DEBUG_TOKENIZER, load_tokenizer

transformers = pytest.importorskip("transformers")
DATE = {"date_string": "26 Jul 2024"}
TOK = load_tokenizer("")


def _hf(folder: Path):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


@pytest.fixture(scope="module", params=sorted(STYLES))
def style(request, tmp_path_factory):
    folder = write_tokenizer_folder(tmp_path_factory.mktemp(request.param), request.param)
    tok = load_tokenizer(folder)
    return request.param, tok, load_chat_template(tok), _hf(folder)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0], strict=True))


# ------------------------------------------------------------------------ ids equal transformers


@pytest.mark.parametrize("case", ["plain", "tools"])
def test_rendered_ids_equal_transformers(style, case):
    name, tok, template, hf = style
    messages, tools = (CONVERSATION, None) if case == "plain" else (TOOL_CONVERSATION, TOOLS)
    ids, _ = ChatEncoder(tok, template, DATE).encode(
        parse_record({"messages": messages, "tools": tools}, "t")
    )
    ref = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **DATE)
    assert ids.tolist() == list(ref)
    prompt = ChatEncoder(tok, template, DATE).prompt_ids(messages[:-1], tools)  # for generation
    assert prompt == hf.apply_chat_template(
        messages[:-1], tools=tools, add_generation_prompt=True, return_dict=False, **DATE
    )
    for gen in (False, True):  # the text too, with and without the generation prompt
        ours = template.render(messages[:-1], gen, tools, DATE)
        assert ours == hf.apply_chat_template(
            messages[:-1], tools=tools, tokenize=False, add_generation_prompt=gen, **DATE
        )
    if name == "qwen2_5":  # the default system message is inserted when none is given
        assert "You are Qwen" in template.render(messages[1:], False, None, DATE)
    else:  # the date lines come from date_string
        assert "Today Date: 26 Jul 2024" in template.render(messages, False, None, DATE)


def test_strftime_now_renders_today_as_transformers(tmp_path):
    folder = write_tokenizer_folder(tmp_path / "llama3", "llama3")
    template = load_chat_template(load_tokenizer(folder))
    ours = template.render(CONVERSATION)
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in ours
    assert ours == _hf(folder).apply_chat_template(CONVERSATION, tokenize=False)


def test_target_is_assistant_content_plus_end_of_turn(style):
    name, tok, template, _ = style
    end = STYLES[name]["end_of_turn"]
    ids, mask = ChatEncoder(tok, template, DATE).encode(
        parse_record({"messages": CONVERSATION}, "t")
    )
    runs = [tok.decode(ids[a:b].tolist()) for a, b in _runs(mask)]
    assert runs == ["Drusa" + end, "The Tholk flows through it." + end]
    ids, mask = ChatEncoder(tok, template, DATE).encode(
        parse_record({"messages": TOOL_CONVERSATION, "tools": TOOLS}, "t")
    )
    runs = [tok.decode(ids[a:b].tolist()) for a, b in _runs(mask)]
    assert len(runs) == 2 and all(r.endswith(end) for r in runs)
    assert "Kelbor" in runs[0] and runs[1] == "Ama Trel founded it." + end
    assert "founder: Ama Trel" not in "".join(runs)  # the tool's answer is not a target


def test_debug_tokenizer_template_equals_transformers_and_keeps_ids(tmp_path):
    template = load_chat_template(TOK)
    assert template is not None and template.origin.endswith("assets/tokenizer_config.json")
    folder = tmp_path / "debug"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(DEBUG_TOKENIZER.read_bytes())
    (folder / "tokenizer_config.json").write_bytes(Path(template.origin).read_bytes())
    ids, mask = ChatEncoder(TOK, template).encode(parse_record({"messages": CONVERSATION}, "t"))
    ref = _hf(folder).apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert ids.tolist() == list(ref)
    runs = [TOK.decode(ids[a:b].tolist()) for a, b in _runs(mask)]
    assert runs == ["Drusa<|eos|>", "The Tholk flows through it.<|eos|>"]
    # the template reuses the existing special tokens: the tokenizer (and its ids) is unchanged
    assert TOK.vocab_size == 2048 and (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)


def test_generation_block_is_tolerated(tmp_path):
    source = (
        "{% for m in messages %}{{ m.role }}:\n{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}<|eos|>{% endgeneration %}{% else %}{{ m.content }}\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}assistant:\n{% endif %}"
    )
    template = ChatTemplate(source, "inline")
    ids, mask = ChatEncoder(TOK, template).encode(parse_record({"messages": CONVERSATION}, "t"))
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(DEBUG_TOKENIZER.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    assert ids.tolist() == list(_hf(folder).apply_chat_template(CONVERSATION, return_dict=False))
    assert [TOK.decode(ids[a:b].tolist()) for a, b in _runs(mask)][0] == "Drusa<|eos|>"


# ----------------------------------------------------------------------------- record forms


def test_prompt_completion_and_text_records():
    enc = ChatEncoder(TOK, load_chat_template(TOK))
    shot = [
        {"role": "user", "content": "Capital of Kelbor?"},
        {"role": "assistant", "content": "Drusa"},  # a few-shot answer in the prompt
        {"role": "user", "content": "Capital of Vel?"},
    ]
    rec = parse_record(
        {"prompt": shot, "completion": [{"role": "assistant", "content": "Om"}]}, "t"
    )
    assert isinstance(rec, Conversation) and rec.first_target == 3
    ids, mask = enc.encode(rec)
    assert TOK.decode(ids[mask].tolist()) == "Om<|eos|>"  # only the completion is a target

    rec = parse_record({"prompt": "Q: capital of Vel? A:", "completion": " Om"}, "t")
    assert isinstance(rec, PlainText)
    ids, mask = enc.encode(rec)
    p, c = TOK.encode("Q: capital of Vel? A:"), TOK.encode(" Om")
    assert ids.tolist() == [TOK.eos_id, *p, *c, TOK.eos_id]
    assert mask.tolist() == [False] * (1 + len(p)) + [True] * (len(c) + 1)

    ids, mask = enc.encode(parse_record({"text": "The capital of Vel is Om."}, "t"))
    assert ids[0] == TOK.eos_id and ids[-1] == TOK.eos_id and mask[1:].all() and not mask[0]
    assert enc.encode(parse_record({"text": "  "}, "t")) is None  # nothing to train on
    no_answer = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
    assert enc.encode(parse_record({"messages": no_answer}, "t")) is None


def test_jsonl_and_parquet_read_the_same_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
            ]
        }
        for i in range(10)
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet", row_group_size=3)
    from_jsonl = read_records(tmp_path / "a.jsonl")
    from_parquet = read_records(tmp_path / "b.parquet")
    assert [r.messages for r in from_jsonl] == [r.messages for r in from_parquet]
    assert from_jsonl[4].where == f"{tmp_path / 'a.jsonl'}:5"
    assert from_parquet[4].where == f"{tmp_path / 'b.parquet'} (row group 1, row 1)"
    assert len(read_records(tmp_path)) == 20  # a folder: both files, sorted


def test_parquet_is_read_one_row_group_at_a_time(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"text": f"doc {i}", "other": "x" * 100} for i in range(50)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet", row_group_size=10)
    calls = []
    original = pq.ParquetFile.read_row_group

    def spy(self, i, columns=None, **kw):
        calls.append((i, tuple(columns)))
        return original(self, i, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("read whole file"))
    assert len(read_records(tmp_path / "c.parquet")) == 50
    assert calls == [(i, ("text",)) for i in range(5)]  # only the needed column


# -------------------------------------------------------------------------------- bad input


def _jsonl(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps(
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
)


@pytest.mark.parametrize(
    "line, error",
    [
        ("{not json", r"bad\.jsonl:2: not JSON .*one a line"),
        (
            '{"conversation": []}',
            r"bad\.jsonl:2: no 'messages', 'prompt' \+ 'completion' or 'text' \(keys: conversation\)",
        ),
        ('{"messages": [{"content": "hi"}]}', r"bad\.jsonl:2: messages\[0\] has no 'role'"),
        (
            '{"messages": [{"role": "bot", "content": "hi"}]}',
            r"bad\.jsonl:2: .*unknown role 'bot': use one of system, user, assistant, tool",
        ),
        ('{"messages": [{"role": "human", "content": "hi"}]}', r"ShareGPT names: human -> user"),
        ('{"messages": []}', r"bad\.jsonl:2: 'messages' must be a non-empty list"),
        ('{"prompt": "p"}', r"bad\.jsonl:2: a record with 'prompt' needs 'completion' too"),
        (
            '{"prompt": "p", "completion": [{"role": "assistant", "content": "a"}]}',
            r"must both be strings .* or both lists of messages",
        ),
        ('{"messages": [{"role": "user"}]}', r"messages\[0\] \(user\) has no 'content'"),
    ],
)
def test_bad_records_name_file_line_and_fix(tmp_path, line, error):
    with pytest.raises(RecordError, match=error):
        read_records(_jsonl(tmp_path, GOOD, line))


def test_parquet_without_the_column_is_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist([{"conversations": "x"}]), tmp_path / "d.parquet")
    with pytest.raises(
        RecordError, match=r"d\.parquet: no 'messages' column.*columns: conversations.*rename"
    ):
        read_records(tmp_path / "d.parquet")


def test_template_that_fails_to_render_quotes_jinja(tmp_path):
    template = ChatTemplate("{{ raise_exception('System role not supported') }}", "strict.jinja")
    rec = parse_record({"messages": CONVERSATION}, "f.jsonl:7")
    with pytest.raises(
        ChatTemplateError,
        match=r"f\.jsonl:7: the chat template \(strict\.jinja\) failed to render it: TemplateError: System role not supported.*data\.chat_template",
    ):
        ChatEncoder(TOK, template).encode(rec)
    broken = ChatTemplate("{{ messages[0].content + 1 }}", "broken.jinja")
    with pytest.raises(ChatTemplateError, match=r"f\.jsonl:7: .*broken\.jinja.*failed to render"):
        ChatEncoder(TOK, broken).encode(rec)


def test_tokenizer_without_a_template_is_refused_when_one_is_needed(tmp_path):
    folder = write_tokenizer_folder(tmp_path / "plain", "qwen2_5", with_template=False)
    tok = load_tokenizer(folder)
    assert load_chat_template(tok) is None
    enc = ChatEncoder(tok, None)
    assert enc.encode(parse_record({"text": "no template needed"}, "t")) is not None
    with pytest.raises(
        ChatTemplateError,
        match=r"x\.jsonl:3: a conversation needs a chat template.*has none.*data\.chat_template",
    ):
        enc.encode(parse_record({"messages": CONVERSATION}, "x.jsonl:3"))
    # data.chat_template: a .jinja file or a tokenizer_config.json
    (tmp_path / "t.jinja").write_text(template_text("qwen2_5"))
    assert load_chat_template(tok, str(tmp_path / "t.jinja")).source == template_text("qwen2_5")
    with pytest.raises(ChatTemplateError, match="does not exist"):
        load_chat_template(tok, str(tmp_path / "missing.jinja"))


def test_a_template_that_is_not_prefix_stable_is_refused():
    # drops the content of assistant turns before the last one (as reasoning templates drop it)
    source = (
        "{% for m in messages %}<|bos|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}...{% else %}{{ m.content }}{% endif %}"
        "<|eos|>\n{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
    )
    rec = parse_record({"messages": CONVERSATION}, "f.jsonl:1")
    with pytest.raises(
        NotPrefixStableError,
        match=r"f\.jsonl:1: .*not prefix-stable at message 2.*train_on = \"all\"",
    ):
        ChatEncoder(TOK, ChatTemplate(source, "think.jinja")).encode(rec)
    with pytest.raises(ChatTemplateError, match="starts with an assistant message"):
        ChatEncoder(TOK, load_chat_template(TOK)).encode(
            parse_record({"messages": CONVERSATION[2:]}, "t")
        )


def test_named_templates_in_tokenizer_config(tmp_path):
    folder = write_tokenizer_folder(tmp_path / "named", "qwen2_5")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": config["chat_template"]},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(load_tokenizer(folder)).source == template_text("qwen2_5")
    (folder / "chat_template.jinja").write_text("{{ 'jinja file wins' }}")  # as in transformers
    assert load_chat_template(load_tokenizer(folder)).render(CONVERSATION) == "jinja file wins"
    config["chat_template"] = [{"name": "tool_use", "template": "x"}]
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        ChatTemplateError, match=re.escape("named templates ['tool_use'] and no 'default'")
    ):
        load_chat_template(load_tokenizer(folder))
