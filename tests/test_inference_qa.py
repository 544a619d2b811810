"""Exact match (engram/inference/qa.py): which questions are asked, how answers are cut and
normalised, and that the score counts what it says. The trained model, the export through
transformers and the training loop's eval_exact_match: tests/test_recipes_sft.py."""

from __future__ import annotations

import json

import pytest
import torch

from engram.config import config_from_dict
from engram.data.synthetic_chat import qa_pairs
from engram.inference import build_for_generation, generate
from engram.inference.qa import Asker, Question, exact_match, normalise_answer, questions

RAW = {
    "job": {"device": "cpu", "seed": 3},
    "model": {"name": "llama3", "flavor": "debug"},
    "engram": {
        "layer_ids": [1], "n_head_per_ngram": 2, "vocab_size_per_ngram": [1009, 997],
        "n_embed_per_ngram": 32, "init": "paper",
    },
    "training": {"seq_len": 64},
    "data": {"dataset": "synthetic_chat", "synthetic_num_entities": 8},
}  # fmt: skip


@pytest.fixture(scope="module")
def init_model():
    cfg = config_from_dict(RAW)
    model, tok, hasher = build_for_generation(cfg, cfg.training.seq_len)
    return cfg, model.eval(), tok, hasher


def test_normalisation_is_the_popqa_one():
    assert normalise_answer("  The Owl.\n") == "the owl"
    assert normalise_answer("Drusa-Kel,  1432!") == "drusakel 1432"
    assert normalise_answer("ÉCLAIR") == "éclair"  # case-folded, letters kept
    assert normalise_answer("...") == ""


def test_synthetic_questions_are_the_qa_pairs_of_the_part(init_model):
    cfg, _, tok, _ = init_model
    for split in ("val", "train"):
        pairs = qa_pairs(1234, 8, "all", 0.5, split)
        asked = questions(cfg, tok, split)
        assert [(q.messages, q.reference) for q in asked] == [
            ([{"role": "user", "content": p.question}], p.answer) for p in pairs
        ]
    assert len(questions(cfg, tok, "train", limit=5)) == 5
    part = config_from_dict({**RAW, "data": {**RAW["data"], "synthetic_part": "finetune"}})
    entities = {q.messages[0]["content"] for q in questions(part, tok, "val")}
    assert entities and entities < {q.messages[0]["content"] for q in questions(cfg, tok, "val")}


def test_chat_questions_ask_the_last_assistant_turn_of_the_split(tmp_path, init_model):
    _, _, tok, _ = init_model
    records = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"},
                      {"role": "user", "content": f"again {i}"},
                      {"role": "assistant", "content": f"b{i}"}]}
        for i in range(3)
    ]  # fmt: skip
    records.insert(2, {"prompt": "2 + 2 =", "completion": " 4"})  # the held-out one of 5
    records.append({"text": "only text"})  # trained on, never asked
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = config_from_dict({**RAW, "data": {"dataset": "chat", "path": str(path)}})
    (held,) = questions(cfg, tok, "val")
    assert (held.prompt, held.reference, held.messages) == ("2 + 2 =", " 4", None)
    train = questions(cfg, tok, "train")
    assert [q.reference for q in train] == ["b0", "b1", "b2"]
    assert train[1].messages == records[1]["messages"][:3] and train[1].where.endswith(":2")
    assert Asker(cfg, tok).prompt_ids(held) == [tok.eos_id, *tok.encode("2 + 2 =")]
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "dataset.json").write_text("{}")
    with pytest.raises(ValueError, match="prepared folder"):
        questions(config_from_dict({**RAW, "data": {"dataset": "chat", "path": str(prepared)}}),
                  tok, "val")  # fmt: skip


def test_generate_stops_at_any_of_several_ids(init_model):
    _, model, tok, hasher = init_model
    prompt = torch.tensor([[tok.eos_id, *tok.encode("The capital of")]])
    free = generate(model, prompt, hasher, 6)[0, prompt.shape[1] :].tolist()
    assert len(free) == 6
    stop = free[2]
    first = free.index(stop)
    out = generate(model, prompt, hasher, 6, eos_id=[tok.pad_id, stop])[0, prompt.shape[1] :]
    assert out.tolist() == free[: first + 1]  # the same tokens up to the first stop id


def test_exact_match_scores_the_greedy_answers(init_model):
    cfg, model, tok, hasher = init_model
    asker = Asker(cfg, tok)
    assert asker.stop_ids == [tok.eos_id]  # the debug template ends a turn with eos
    items = questions(cfg, tok, "val", limit=4)
    first = exact_match(model, hasher, asker, items, 5)
    assert (first.total, first.skipped, first.correct) == (4, 0, 0)
    for q, a in zip(items, first.answers, strict=True):
        assert a.prompt_ids == asker.encoder.prompt_ids(q.messages)
        header = tok.encode("<|bos|>assistant\n")  # the generation prompt ends the prompt
        assert a.prompt_ids[-len(header) :] == header
        assert not set(a.answer_ids) & set(asker.stop_ids) and len(a.answer_ids) <= 5
    # The same questions with the model's own answers as references (punctuation and case
    # changed: normalised away) score 1; a long prompt is skipped and counted.
    echoed = [
        Question(q.where, f" {a.text.upper()}!", q.messages)
        for q, a in zip(items, first.answers, strict=True)
        if normalise_answer(a.text)
    ]
    long = Question("long", "x", [{"role": "user", "content": "word " * 80}])
    again = exact_match(model, hasher, asker, [*echoed, long], 5)
    assert echoed and (again.correct, again.total, again.skipped) == (len(echoed), len(echoed), 1)
    assert again.score == 1.0
