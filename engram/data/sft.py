"""Fine-tuning sequences: tokenised conversations (ids + target mask) -> training samples.

Batch keys (the same as plain text, so the model, CP's split and the loss need nothing new):

    input_ids    int64 [T]  x[:-1] of a row x of T + 1 tokens
    labels       int64 [T]  x[1:] where that token is a target of the SAME conversation as the
                            input token before it, else -100: prompts (train_on = "assistant"),
                            the first token of each conversation (nothing before it in its own
                            conversation; in particular never the last token of the previous
                            one) and padding are never targets
    segment_ids  int64 [T]  conversation index within the row, 0..k-1, non-decreasing;
                            PADDING IS ITS OWN FINAL SEGMENT k (not -1), so a row with padding
                            has k + 1 segments and positions / masks can treat every segment
                            alike. Document-masked attention and position resets (and Engram's
                            n-gram reset, which the chat datasets always apply) read this.

Rows (the packing plan), built once per split at start: the conversations, in one seeded
order, are packed next-fit into rows of T + 1 tokens (`pack = true`: a conversation that does
not fit the rest of the row starts the next one; the rest is padding), or one per row
(`pack = false`). A conversation never spans two rows. One longer than T + 1 tokens follows
`overflow`: truncate (its first T + 1 tokens; dropped instead if that leaves no target), drop, or
error. Each epoch visits the rows in a seeded order (the keyed Feistel permutation of tokens.py,
evaluated per index), so sample j is computed from j alone: a (rank, worker) builds only the rows
it delivers, and the loader state is the global sample index, resumable at any dp size.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Protocol

import numpy as np

from engram.data.tokens import EpochOrder

logger = logging.getLogger("engram")
IGNORE = -100
_SHOW = 3  # locations named per count in the start-up line


class ConversationTable(Protocol):
    """Tokenised conversations by index: lengths, (ids, mask) and where each came from."""

    fingerprint: str

    @property
    def lengths(self) -> np.ndarray: ...

    def read(self, index: int, count: int) -> tuple[np.ndarray, np.ndarray]: ...

    def where(self, index: int) -> str: ...


class ConversationArrays:
    """Conversations held in memory: concatenated ids / masks and exclusive end offsets."""

    def __init__(
        self, ids: list[np.ndarray], masks: list[np.ndarray], where: list[str], fingerprint: str
    ) -> None:
        self.ids = np.concatenate(ids) if ids else np.zeros(0, np.int32)
        self.mask = np.concatenate(masks) if masks else np.zeros(0, bool)
        self.ends = np.cumsum([len(x) for x in ids], dtype=np.int64)
        self._where = where
        self.fingerprint = fingerprint

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.ends, prepend=0)

    def read(self, index: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        start = int(self.ends[index - 1]) if index else 0
        return self.ids[start : start + count], self.mask[start : start + count]

    def where(self, index: int) -> str:
        return self._where[index]


def _first(items: list[str]) -> str:
    more = f", ... ({len(items) - _SHOW} more)" if len(items) > _SHOW else ""
    return f" (first: {', '.join(items[:_SHOW])}{more})" if items else ""


class SftSamples:
    """Sample j of one split of a conversation table, by index (what TokenSource serves)."""

    def __init__(
        self,
        table: ConversationTable,
        members: np.ndarray,
        seq_len: int,
        *,
        pack: bool,
        overflow: str,
        train_on: str,
        seed: int,
        split: str,
        pad_id: int,
        skipped: list[str] | None = None,
        name: str = "chat",
    ) -> None:
        self.table = table
        self.cap = seq_len + 1
        self.train_on = train_on
        self.pad_id = pad_id
        self.split = split
        order = np.asarray(members, dtype=np.int64)
        order = order[np.random.default_rng([seed, 0x5F7, 2]).permutation(len(order))]
        lengths = table.lengths[order]
        long = lengths > self.cap
        if overflow == "error" and long.any():
            where = [table.where(int(i)) for i in np.sort(order[long])[:_SHOW]]
            raise ValueError(
                f"{name} ({split}): {int(long.sum())} conversation(s) longer than "
                f"training.seq_len + 1 = {self.cap} tokens{_first(where)}: raise "
                'training.seq_len, or set data.overflow = "truncate" or "drop"'
            )
        keep = ~long
        truncated: list[str] = []
        dropped: list[str] = []
        emptied: list[str] = []
        long_at = np.nonzero(long)[0]
        for k in long_at[np.argsort(order[long_at])].tolist():  # named in input order
            i = int(order[k])
            if overflow == "drop":
                dropped.append(table.where(i))
            elif train_on == "all" or table.read(i, self.cap)[1][1:].any():
                keep[k] = True
                truncated.append(table.where(i))
            else:  # truncation cut off every target
                emptied.append(table.where(i))
        self.conv = order[keep]
        self.length = np.minimum(lengths[keep], self.cap)
        if len(self.conv) == 0:
            raise ValueError(
                f"{name} ({split}): no conversation is left to train on: "
                f"{self._counts(skipped or [], truncated, dropped, emptied)}. Fix the data, raise "
                "training.seq_len, or change data.overflow"
            )
        self.bounds = self._rows(pack)
        self.rows = len(self.bounds) - 1
        self.row_of = EpochOrder(self.rows, [seed, 0x5F7, 1 if split == "val" else 0])
        counts = self._counts(skipped or [], truncated, dropped, emptied)
        self.report = {
            "conversations": len(self.conv),
            "rows": self.rows,
            "truncated": len(truncated),
            "dropped": len(dropped) + len(emptied),
            "skipped": len(skipped or []),
            "fill": float(self.length.sum()) / (self.rows * self.cap),
        }
        logger.info(
            f"{name} ({split}): {len(self.conv)} conversations in {self.rows} sequences of "
            f"{self.cap} tokens ({'packed' if pack else 'one per sequence'}, "
            f"{self.report['fill']:.0%} filled); {counts}"
        )
        h = hashlib.sha256(
            f"{table.fingerprint}/{self.cap}/{pack}/{overflow}/{train_on}/{split}".encode()
        )
        self.fingerprint = h.hexdigest()[:16]

    @staticmethod
    def _counts(
        skipped: list[str], truncated: list[str], dropped: list[str], emptied: list[str]
    ) -> str:
        parts = [
            f"{len(items)} {what}{_first(items)}"
            for items, what in (
                (skipped, "skipped without an assistant turn or text"),
                (truncated, "truncated to seq_len + 1"),
                (dropped, "dropped as longer than seq_len + 1"),
                (emptied, "dropped as truncation left no target"),
            )
            if items
        ]
        return ", ".join(parts) or "none skipped, truncated or dropped"

    def _rows(self, pack: bool) -> np.ndarray:
        """Row r holds conversations conv[bounds[r]:bounds[r + 1]] (next-fit in conv order)."""
        if not pack:
            return np.arange(len(self.conv) + 1, dtype=np.int64)
        bounds, used = [0], 0
        for i, n in enumerate(self.length.tolist()):
            if used + n > self.cap:
                bounds.append(i)
                used = 0
            used += n
        bounds.append(len(self.length))
        return np.asarray(bounds, dtype=np.int64)

    def row(self, r: int) -> dict[str, np.ndarray]:
        x = np.full(self.cap, self.pad_id, dtype=np.int64)
        target = np.zeros(self.cap, dtype=bool)
        lo, hi = int(self.bounds[r]), int(self.bounds[r + 1])
        seg = np.full(self.cap, hi - lo, dtype=np.int64)  # padding: its own final segment
        at = 0
        for s, (c, n) in enumerate(
            zip(self.conv[lo:hi].tolist(), self.length[lo:hi].tolist(), strict=True)
        ):
            ids, mask = self.table.read(c, n)
            x[at : at + n] = ids
            target[at : at + n] = True if self.train_on == "all" else mask
            seg[at : at + n] = s
            at += n
        same = seg[1:] == seg[:-1]
        labels = np.where(target[1:] & same, x[1:], IGNORE)
        return {"input_ids": x[:-1], "labels": labels, "segment_ids": seg[:-1]}

    def samples(self, first: int, count: int) -> list[dict[str, np.ndarray]]:
        rows = self.row_of(np.arange(first, first + count, dtype=np.int64))
        return [self.row(int(r)) for r in rows]

    def samples_per_source(self, consumed: int) -> dict[str, int]:
        return {}
