"""A prepared chat folder (prepare_sft.py writes it) as a conversation table, memory-mapped.

Checked on open, O(shards) plus one read of the conversation ends (8 bytes a conversation, what
the packing plan needs): the run's tokenizer made it, its ids fit the vocabulary, the run
renders with the template it was prepared with, and no file is truncated or missing. A
conversation's ids and mask are read from the maps when a row holding it is built.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engram.data.shards import (
    MANIFEST,
    PREPARE_HINT,
    SFT_FORMAT,
    _Mapped,
    _token_dtype_of,
    check_made_by,
    check_shard_file,
    read_manifest,
)


def is_prepared(path: str | Path) -> bool:
    """A folder written by prepare (holds dataset.json) rather than a folder of records."""
    return (Path(path) / MANIFEST).is_file()


class SftShards:
    """Conversations of a prepared chat folder by index: lengths, (ids, mask), where."""

    def __init__(
        self,
        folder: str | Path,
        fingerprint: str | None,
        vocab_size: int,
        template_sha: str | None,
        template_kwargs: dict | None = None,
    ) -> None:
        self.folder = Path(folder)
        m = read_manifest(self.folder, SFT_FORMAT)
        where = self.folder / MANIFEST
        check_made_by(m, where, fingerprint, vocab_size)
        prepared = m["chat_template"]
        if prepared is not None and prepared["sha256"] != template_sha:
            raise ValueError(
                f"{where}: the conversations were rendered with the chat template "
                f"{prepared['origin']} (sha256 {prepared['sha256']}), this run's template is "
                f"{template_sha or 'none'}: set data.chat_template to the one prepare used, or "
                f"re-run {PREPARE_HINT} --chat with this run's template"
            )
        if prepared is not None and m["chat_template_kwargs"] != (template_kwargs or {}):
            raise ValueError(
                f"{where}: the conversations were rendered with chat_template_kwargs "
                f"{m['chat_template_kwargs']}, this run sets {template_kwargs or {}}: set "
                "data.chat_template_kwargs to what prepare used, or re-run prepare with this run's"
            )
        self.manifest = m
        self.fingerprint = m["fingerprint"]
        dtype = _token_dtype_of(m, where, vocab_size)
        self._tokens: list[_Mapped] = []
        self._masks: list[_Mapped] = []
        ends, lengths, counts = [], [], []
        for shard in m["shards"]:
            base = self.folder / shard["name"]
            n_tok, n_conv = shard["tokens"], shard["conversations"]
            check_shard_file(base.with_suffix(".bin"), n_tok * dtype.itemsize, self.folder)
            check_shard_file(base.with_suffix(".idx"), n_conv * 8, self.folder)
            check_shard_file(base.with_suffix(".mask"), (n_tok + 7) // 8, self.folder)
            self._tokens.append(_Mapped(base.with_suffix(".bin"), dtype))
            self._masks.append(_Mapped(base.with_suffix(".mask"), np.dtype("u1")))
            local = np.fromfile(base.with_suffix(".idx"), dtype="<u8").astype(np.int64)
            if len(local) and local[-1] != n_tok:
                raise ValueError(
                    f"{base.with_suffix('.idx')}: its last conversation ends at {local[-1]}, the "
                    f"shard holds {n_tok} tokens: the shard is corrupt; re-run {PREPARE_HINT} --chat"
                )
            ends.append(local)
            lengths.append(np.diff(local, prepend=0))
            counts.append(n_conv)
        self.ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)  # within its shard
        self._lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.shard_of = np.repeat(np.arange(len(counts)), counts)
        self.first = np.concatenate([[0], np.cumsum(counts)])  # first conversation of each shard
        self.max_id = vocab_size - 1

    def __len__(self) -> int:
        return len(self.ends)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def read(self, index: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        k = int(self.shard_of[index])
        start = 0 if index == self.first[k] else int(self.ends[index - 1])
        stop = start + count
        tokens = self._tokens[k].array[start:stop].astype(np.int64)
        self._tokens[k].release(start, stop)
        if len(tokens) and int(tokens.max()) > self.max_id:
            raise ValueError(
                f"{self.where(index)}: token id {int(tokens.max())} >= vocabulary "
                f"{self.max_id + 1}: the shard is corrupt; re-run {PREPARE_HINT} --chat"
            )
        lo, hi = start // 8, (stop + 7) // 8
        bits = np.unpackbits(self._masks[k].array[lo:hi], bitorder="little")
        self._masks[k].release(lo, hi)
        return tokens, bits[start - lo * 8 : stop - lo * 8].astype(bool)

    def where(self, index: int) -> str:
        k = int(self.shard_of[index])
        return f"{self.folder} conversation {index} ({self.manifest['shards'][k]['name']})"
