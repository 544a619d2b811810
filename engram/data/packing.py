"""Packing documents into fixed-length training sequences.

The token stream is doc_0 + [eos] + doc_1 + [eos] + ...; it is cut into consecutive,
non-overlapping chunks of seq_len + 1 tokens x, giving input_ids = x[:-1] and labels = x[1:].
A position in the stream is (document index, offset into that document's tokens incl. its eos),
so the packer can be saved and restored with two integers: no packing buffer to serialise.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engram.data.datasets import DocumentSource


def segment_ids(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """Document index within the sequence: 0 at the start, +1 after each eos. Works on [..., T]."""
    is_eos = (inputs == eos_id).astype(np.int64)
    seg = np.cumsum(is_eos, axis=-1) - is_eos  # exclusive cumsum: eos belongs to its document
    return seg


class TokenStream:
    """Cursor over the eos-separated token stream of a document source."""

    def __init__(
        self,
        docs: DocumentSource,
        encode: Callable[[str], list[int]],
        eos_id: int,
        doc: int = 0,
        offset: int = 0,
    ) -> None:
        self.docs = docs
        self.encode = encode
        self.eos_id = eos_id
        self.doc = doc
        self.offset = offset
        self._tokens = self._tokenise(doc)
        if offset >= len(self._tokens):
            raise ValueError(f"offset {offset} is past the end of document {doc}")

    def _tokenise(self, doc: int) -> np.ndarray:
        ids = self.encode(self.docs[doc])
        out = np.empty(len(ids) + 1, dtype=np.int64)
        out[:-1] = ids
        out[-1] = self.eos_id
        return out

    def _advance_doc(self) -> None:
        self.doc += 1
        self.offset = 0
        self._tokens = self._tokenise(self.doc)

    def take(self, n: int) -> np.ndarray:
        """The next n tokens; the cursor moves past them."""
        out = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            chunk = self._tokens[self.offset : self.offset + n - filled]
            out[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
            self.offset += len(chunk)
            if self.offset == len(self._tokens):
                self._advance_doc()
        return out

    def skip(self, n: int) -> None:
        """Move the cursor n tokens forward (still tokenises the documents it passes)."""
        while n > 0:
            step = min(n, len(self._tokens) - self.offset)
            n -= step
            self.offset += step
            if self.offset == len(self._tokens):
                self._advance_doc()


def make_sample(x: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """One packed chunk of seq_len + 1 tokens -> input_ids, labels, segment_ids (all [seq_len])."""
    inputs = x[:-1]
    return {"input_ids": inputs, "labels": x[1:], "segment_ids": segment_ids(inputs, eos_id)}
