"""A record -> token ids + a target mask (True where the token is to be predicted).

Conversations: the ids are the tokenizer's encoding of the whole rendering (add_special_tokens
= False), i.e. exactly transformers' `apply_chat_template(messages, tokenize=True)`. The mask
comes from the template's own rendered spans, by incremental rendering (no string guessing):
for each target assistant turn i,

    before  = render(messages[:i], add_generation_prompt=True)
    through = render(messages[:i + 1])

must be prefixes of each other and of the whole rendering (else the template is not
prefix-stable: an error, since the turn cannot be located), and the characters
[len(before), len(through)) are the turn. Tokens overlapping that span are targets (character
offsets of the fast tokenizer), cut after the span's last special token: the end-of-turn token
(<|im_end|>, <|eot_id|>) is a target, the template's whitespace after it ("\\n") is not, since
generation stops at it. So a turn's target is its content plus its end-of-turn token.

Plain text (no template): [eos] + prompt + completion + [eos], the prompt and completion
tokenised separately (as a prompt is at inference). The leading eos is how this repo starts a
document everywhere (the packer, the export's post-processor, recipes/generate.py --prefix
eos); the completion and the final eos are the targets (all of a `text` record).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engram.data.chat_records import Conversation, PlainText, Record
from engram.data.chat_template import ChatTemplate, ChatTemplateError, missing_template_error


class NotPrefixStableError(ChatTemplateError):
    """The template renders earlier turns differently once later turns follow."""


class ChatEncoder:
    """Encodes records with one tokenizer and (when a conversation needs one) a template."""

    def __init__(
        self, tokenizer: Any, template: ChatTemplate | None, kwargs: dict[str, Any] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.kwargs = dict(kwargs or {})
        added = tokenizer.hf.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)

    def encode(self, record: Record) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids int32 [L], mask bool [L]), or None when the record has nothing to train on
        (a conversation without a target assistant turn, an empty text / completion)."""
        if isinstance(record, PlainText):
            return self._plain(record)
        return self._conversation(record)

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The ids a model answers from (generation, exact-match evaluation): the rendering with
        add_generation_prompt=True, i.e. apply_chat_template(..., add_generation_prompt=True)."""
        if self.template is None:
            raise missing_template_error(self.tokenizer, "a prompt")
        text = self.template.render(messages, True, tools, {**self.kwargs, **(kwargs or {})})
        return self.tokenizer.hf.encode(text, add_special_tokens=False).ids

    def _plain(self, rec: PlainText) -> tuple[np.ndarray, np.ndarray] | None:
        if not rec.completion.strip():
            return None
        tok = self.tokenizer
        prompt, completion = tok.encode(rec.prompt), tok.encode(rec.completion)
        ids = np.asarray([tok.eos_id, *prompt, *completion, tok.eos_id], dtype=np.int32)
        mask = np.zeros(len(ids), dtype=bool)
        mask[1 + len(prompt) :] = True
        return ids, mask

    def _render(self, rec: Conversation, messages: list, generation_prompt: bool) -> str:
        assert self.template is not None
        kwargs = {**self.kwargs, **(rec.kwargs or {})}
        return self.template.render(messages, generation_prompt, rec.tools, kwargs, rec.where)

    def _conversation(self, rec: Conversation) -> tuple[np.ndarray, np.ndarray] | None:
        turns = [
            i
            for i, m in enumerate(rec.messages)
            if m["role"] == "assistant" and i >= rec.first_target
        ]
        if not turns:
            return None
        if self.template is None:
            raise missing_template_error(self.tokenizer, rec.where)
        if turns[0] == 0:
            raise ChatTemplateError(
                f"{rec.where}: the conversation starts with an assistant message: nothing prompts "
                "it. Put a system or user message first"
            )
        full = self._render(rec, rec.messages, False)
        enc = self.tokenizer.hf.encode(full, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        special = (
            np.isin(ids, list(self.special_ids)) if self.special_ids else np.zeros_like(ids, bool)
        )
        mask = np.zeros(len(ids), dtype=bool)
        for i in turns:
            before = self._render(rec, rec.messages[:i], True)
            through = self._render(rec, rec.messages[: i + 1], False)
            if not (through.startswith(before) and full.startswith(through)):
                raise NotPrefixStableError(
                    f"{rec.where}: the chat template ({self.template.origin}) is not "
                    f"prefix-stable at message {i}: rendering the conversation up to that "
                    "assistant turn (with add_generation_prompt) and through it does not give the "
                    "start of the whole rendering (the template renders earlier turns "
                    "differently once later turns follow, e.g. it drops their reasoning), so the "
                    'turn cannot be located. Use data.train_on = "all", split the conversation '
                    "at that turn, or a template without that behaviour (data.chat_template)"
                )
            start, stop = len(before), len(through)
            inside = np.nonzero((offsets[:, 1] > start) & (offsets[:, 0] < stop))[0]
            ends = inside[special[inside]]
            if len(ends):
                inside = inside[inside <= ends[-1]]
            mask[inside] = True
        return (ids, mask) if mask.any() else None


def encode_records(
    encoder: ChatEncoder, records: list[Record]
) -> tuple[list[np.ndarray], list[np.ndarray], list[str], list[str]]:
    """Encoded ids and masks of the records that have targets, their locations, and the
    locations of those skipped for having none."""
    ids, masks, where, skipped = [], [], [], []
    for rec in records:
        out = encoder.encode(rec)
        if out is None:
            skipped.append(rec.where)
            continue
        ids.append(out[0])
        masks.append(out[1])
        where.append(rec.where)
    return ids, masks, where, skipped
