"""Exact match: greedy answers to held-out questions against their reference answers.

Used by scripts/eval_qa.py (a run's checkpoint, or its export through transformers) and by the
training loop (`data.eval_exact_match`, logged as `eval_exact_match`).

A question (`Question`) is a conversation up to its last assistant turn, and the reference is
that turn's content:

- `synthetic_chat`: the (question, answer) pairs of `synthetic_chat.qa_pairs` for the run's part
  and split: "val" asks every fact once in a held-out phrasing, "train" in each training phrasing
  (one user message each);
- `chat` (records on disk): the conversations of the split (`val`: the ~1% the loader holds out,
  `train`: the others), each asked for its last assistant turn with every message before it as
  context; a plain `prompt` + `completion` record asks its prompt, rendered as training renders it
  (`[eos] prompt`); `text` records ask nothing. A prepared folder holds token ids only: refused.

The prompt is rendered by the chat template with `add_generation_prompt=True`
(`ChatEncoder.prompt_ids`, equal to transformers' `apply_chat_template(...,
add_generation_prompt=True)`); decoding is greedy and stops at eos or the template's end-of-turn
token (the export's generation_config stops at both). The answer is the text of the new tokens
before that stop, special tokens skipped.

Normalisation (`normalise_answer`, as the PopQA example of the Engram PEFT library): case-folded,
punctuation removed (anything but word characters and whitespace), whitespace collapsed and
stripped. Exact match is the share of questions whose normalised answer equals the normalised
reference.

Several ranks (FSDP / HSDP / DDP; the caller's `group`) answer disjoint shares of the questions:
rank r takes questions r, r + n, ...; in every round each rank decodes one question and all stop
together (generate's `group`: their forwards gather the same FSDP shards and exchange Engram table
rows), a rank out of questions repeats one without counting it; the counts are summed over the
group. A question whose prompt plus max_new_tokens exceeds the model's max_seq_len is skipped and
counted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engram.config import JobConfig
from engram.data.chat_dataset import split_locations
from engram.data.chat_encode import ChatEncoder
from engram.data.chat_records import Conversation, PlainText, read_records
from engram.data.chat_template import chat_template_fields, load_chat_template
from engram.data.sft_shards import is_prepared
from engram.data.synthetic_chat import qa_pairs
from engram.data.tokenizer import Tokenizer
from engram.hashing.ngram import NgramHasher
from engram.inference.decode import generate
from engram.models.transformer import Transformer

_PUNCTUATION = re.compile(r"[^\w\s]")


def normalise_answer(text: str) -> str:
    """Case-folded, punctuation removed, whitespace collapsed and stripped."""
    return " ".join(_PUNCTUATION.sub("", text.casefold()).split())


@dataclass(frozen=True)
class Question:
    """A prompt (`messages` for the chat template, or a plain `prompt`) and its reference."""

    where: str
    reference: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    kwargs: dict[str, Any] | None = None


def _from_record(rec: Conversation | PlainText) -> Question | None:
    if isinstance(rec, PlainText):
        if not rec.prompt.strip() or not rec.completion.strip():
            return None  # a text record asks nothing
        return Question(rec.where, rec.completion, prompt=rec.prompt)
    last = [
        i
        for i, m in enumerate(rec.messages)
        if m["role"] == "assistant" and i >= max(rec.first_target, 1)
    ]
    if not last or not isinstance(rec.messages[last[-1]].get("content"), str):
        return None
    i = last[-1]
    return Question(
        rec.where, rec.messages[i]["content"], rec.messages[:i], tools=rec.tools, kwargs=rec.kwargs
    )


def questions(cfg: JobConfig, tokenizer: Tokenizer, split: str, limit: int = 0) -> list[Question]:
    """The questions of `split` ("val" or "train") of the run's chat data, in order; the first
    `limit` (0: all)."""
    data = cfg.data
    if split not in ("train", "val"):
        raise ValueError(f"unknown split {split!r}; valid splits: train, val")
    if data.dataset == "synthetic_chat":
        pairs = qa_pairs(
            data.synthetic_seed,
            data.synthetic_num_entities,
            data.synthetic_part,
            data.synthetic_pretrain_fraction,
            split,
        )
        out = [
            Question(
                f"synthetic_chat[{data.synthetic_part}/{split}] #{k}",
                qa.answer,
                [{"role": "user", "content": qa.question}],
            )
            for k, qa in enumerate(pairs)
        ]
    elif data.dataset == "chat":
        if is_prepared(data.path):
            raise ValueError(
                f"exact match asks the conversations' messages, but {data.path} is a prepared "
                "folder (token ids only): point data.path at the .jsonl / .parquet records it was "
                "prepared from for the evaluation (scripts/eval_qa.py --data.path=...), or set "
                "data.eval_exact_match = 0"
            )
        wanted = split_locations(cfg, tokenizer, split)
        by_where = {rec.where: rec for rec in read_records(data.path)}
        out = [q for q in (_from_record(by_where[w]) for w in wanted) if q is not None]
    else:
        raise ValueError(
            f"exact match needs question / answer data: data.dataset = {data.dataset!r} is plain "
            'text; use "chat" or "synthetic_chat"'
        )
    if not out:
        raise ValueError(f"no questions in the {split} split of data.dataset = {data.dataset!r}")
    return out[:limit] if limit else out


@dataclass
class Answer:
    where: str
    prompt_ids: list[int]
    answer_ids: list[int]
    """The new tokens before the stop token."""
    text: str
    reference: str

    @property
    def correct(self) -> bool:
        return normalise_answer(self.text) == normalise_answer(self.reference)


@dataclass
class ExactMatch:
    correct: int = 0
    total: int = 0
    """Questions answered (over every rank of the group)."""
    skipped: int = 0
    """Questions whose prompt + max_new_tokens exceed the model's max_seq_len."""
    answers: list[Answer] = field(default_factory=list)
    """This rank's answers."""

    @property
    def score(self) -> float:
        return self.correct / self.total if self.total else 0.0


class Asker:
    """Prompt ids and stop ids of the run's tokenizer and chat template (data.chat_template,
    data.chat_template_kwargs), and the answer text of generated ids."""

    def __init__(self, cfg: JobConfig, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        template = load_chat_template(tokenizer, cfg.data.chat_template)
        self.encoder = ChatEncoder(tokenizer, template, cfg.data.chat_kwargs())
        _, turn_ends = chat_template_fields(tokenizer, cfg.data.chat_template)
        self.stop_ids = [tokenizer.eos_id, *turn_ends]

    def prompt_ids(self, q: Question) -> list[int]:
        if q.messages is None:  # plain text, as training renders a prompt / completion record
            return [self.tokenizer.eos_id, *self.tokenizer.encode(q.prompt or "")]
        return self.encoder.prompt_ids(q.messages, q.tools, q.kwargs)

    def answer_ids(self, new_ids: list[int]) -> list[int]:
        """The new tokens before the first stop token."""
        stop = next((k for k, t in enumerate(new_ids) if t in self.stop_ids), len(new_ids))
        return new_ids[:stop]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.hf.decode(ids, skip_special_tokens=True)


@torch.no_grad()
def exact_match(
    model: Transformer,
    hasher: NgramHasher | None,
    asker: Asker,
    items: list[Question],
    max_new_tokens: int,
    group: dist.ProcessGroup | None = None,
) -> ExactMatch:
    """Greedy answers of `model` (in eval mode: the caller's) to `items` (module docstring)."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)
    prompts = [asker.prompt_ids(q) for q in items]
    fits = [i for i, p in enumerate(prompts) if len(p) + max_new_tokens <= model.args.max_seq_len]
    mine = fits[rank::world]
    result = ExactMatch(skipped=len(items) - len(fits))
    for r in range(math.ceil(len(fits) / world)):
        i = mine[r] if r < len(mine) else fits[0]  # out of questions: decode one, uncounted
        out = generate(
            model, torch.tensor([prompts[i]]), hasher, max_new_tokens,
            eos_id=asker.stop_ids, vocab_size=asker.tokenizer.vocab_size, group=group,
        )  # fmt: skip
        if r < len(mine):
            ids = asker.answer_ids(out[0, len(prompts[i]) :].tolist())
            q = items[i]
            result.answers.append(Answer(q.where, prompts[i], ids, asker.text(ids), q.reference))
    counts = torch.tensor([sum(a.correct for a in result.answers), len(result.answers)])
    if group is not None:
        counts = counts.to(model.rope_cache.device)
        dist.all_reduce(counts, group=group)
    result.correct, result.total = int(counts[0]), int(counts[1])
    return result
