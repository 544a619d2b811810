"""On-disk format of prepared token datasets: scripts/prepare_data.py writes it, the loader reads it.

A prepared folder holds, per shard k:

    shard_0000k.bin   token ids, little-endian uint16 (vocabulary <= 65536) or uint32, documents
                      back to back (each followed by the separator prepare was told to append)
    shard_0000k.idx   uint64 exclusive end offset of every document in the shard (last = tokens)
    shard_0000k.json  the shard header, renamed into place LAST: a shard without it is unfinished

and `dataset.json`, the manifest, written once every shard is finished. Readers map the files
(nothing is read whole; the page cache is shared by every process of a node) and drop the pages
they touched after each read, so a reader's RSS stays small whatever the corpus size.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from engram.data.tokenizer import Tokenizer

FORMAT = "engram-tokens/1"
MANIFEST = "dataset.json"
PREPARE_HINT = (
    "scripts/prepare_data.py --input <corpus> --out <folder> --tokenizer <tokenizer.json>"
)


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """Hash of the tokenizer's canonical JSON (vocab, merges, normalizer, special tokens)."""
    return tok.fingerprint


def write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class _Mapped:
    """Read-only map of one file as a 1-D array; opened lazily so it is never pickled."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path = path
        self.dtype = dtype
        self._mm: mmap.mmap | None = None
        self._arr: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "dtype": self.dtype, "_mm": None, "_arr": None}

    @property
    def array(self) -> np.ndarray:
        if self._arr is None:
            with self.path.open("rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._arr = np.frombuffer(self._mm, dtype=self.dtype)
        return self._arr

    def release(self, start: int = 0, stop: int | None = None) -> None:
        """Drop this process's mapping of elements [start, stop) (the page cache keeps them)."""
        if self._mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        item = self.dtype.itemsize
        lo = (start * item) // mmap.PAGESIZE * mmap.PAGESIZE
        hi = len(self._mm) if stop is None else min(len(self._mm), stop * item)
        if hi > lo:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


SFT_FORMAT = "engram-sft/1"  # chat shards (sft_shards.py): the same files plus a mask bitmap
_READ_BY = {FORMAT: 'data.dataset = "tokens"', SFT_FORMAT: 'data.dataset = "chat"'}


def read_manifest(folder: Path, expect: str = FORMAT) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        unfinished = sorted(folder.glob("shard_*.json")) if folder.is_dir() else []
        hint = (
            "prepare was interrupted: rerun the same prepare command to finish it"
            if unfinished
            else f"prepare the corpus first: {PREPARE_HINT}"
        )
        raise FileNotFoundError(f"{path} is missing, so {folder} is not a prepared dataset: {hint}")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    found = manifest.get("format")
    if found != expect:
        fix = (
            f"it is read with {_READ_BY[found]}" if found in _READ_BY else f"re-run {PREPARE_HINT}"
        )
        raise ValueError(f"{path}: format {found!r}, this loader reads {expect!r}: {fix}")
    return manifest


def check_made_by(m: dict[str, Any], where: Path, fingerprint: str | None, vocab_size: int) -> None:
    """The prepared folder was made with the run's tokenizer and fits the model's vocabulary."""
    tok = m["tokenizer"]
    if fingerprint is not None and tok["fingerprint"] != fingerprint:
        raise ValueError(
            f"{where}: the tokens were made with tokenizer {tok['path'] or '<debug>'} "
            f"(fingerprint {tok['fingerprint']}), not with this run's tokenizer "
            f"(fingerprint {fingerprint}): set model.tokenizer_path to the tokenizer that "
            f"prepared the data, or re-run {PREPARE_HINT} with this run's tokenizer"
        )
    if m["max_token_id"] >= vocab_size:
        raise ValueError(
            f"{where}: token id {m['max_token_id']} does not fit the model's vocabulary of "
            f"{vocab_size}: use the tokenizer that prepared the data (and a model.vocab_size "
            "at least its size)"
        )


def check_shard_file(path: Path, expect: int, folder: Path) -> None:
    """A shard file exists with the size its header says."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the prepared dataset {folder} is incomplete; "
            f"delete {folder / MANIFEST} and rerun the prepare command"
        )
    size = path.stat().st_size
    if size != expect:
        raise ValueError(
            f"{path} has {size} bytes, its header says {expect}: the shard is "
            f"truncated or corrupt; delete {path.with_suffix('.json')} and "
            f"{folder / MANIFEST} and rerun the prepare command to rewrite it"
        )


TOKEN_DTYPES = ("<u2", "<u4")  # what prepare writes (token_dtype)


def _token_dtype_of(manifest: dict[str, Any], where: Path, vocab_size: int) -> np.dtype:
    """The shards' token dtype: one prepare writes, wide enough for every id."""
    name = manifest.get("dtype")
    if name not in TOKEN_DTYPES:
        raise ValueError(
            f"{where}: token dtype {name!r} is not one prepare writes ({', '.join(TOKEN_DTYPES)}: "
            f"little-endian uint16 / uint32); the shards would be read as other numbers. Restore "
            f"the file, or re-run {PREPARE_HINT}"
        )
    dtype = np.dtype(name)
    largest = max(int(manifest["max_token_id"]), vocab_size - 1)
    if largest > np.iinfo(dtype).max:
        raise ValueError(
            f"{where}: token dtype {name} holds ids up to {np.iinfo(dtype).max}, but the "
            f"vocabulary needs {largest}: the header does not match the shards; re-run "
            f"{PREPARE_HINT}"
        )
    return dtype


class TokenShards:
    """One prepared folder: tokens and document ends of the concatenated shards, by index.

    Checked on open (headers and file sizes only, O(shards)): the run's tokenizer made it, its
    ids fit the model's vocabulary, and no shard is truncated or lacks its index.
    """

    def __init__(self, folder: str | Path, fingerprint: str | None, vocab_size: int) -> None:
        self.folder = Path(folder)
        m = read_manifest(self.folder)
        where = self.folder / MANIFEST
        check_made_by(m, where, fingerprint, vocab_size)
        self.manifest = m
        self.fingerprint = m["fingerprint"]
        self.dtype = _token_dtype_of(m, where, vocab_size)
        self.eos_id = int(m["tokenizer"]["eos_id"])
        self._tokens: list[_Mapped] = []
        self._ends: list[_Mapped] = []
        counts = []
        for shard in m["shards"]:
            bin_path = self.folder / f"{shard['name']}.bin"
            idx_path = self.folder / f"{shard['name']}.idx"
            check_shard_file(bin_path, shard["tokens"] * self.dtype.itemsize, self.folder)
            check_shard_file(idx_path, shard["docs"] * 8, self.folder)
            self._tokens.append(_Mapped(bin_path, self.dtype))
            self._ends.append(_Mapped(idx_path, np.dtype("<u8")))
            counts.append(shard["tokens"])
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_tokens = int(self.starts[-1])
        self._reads = 0

    def _pieces(self, start: int, stop: int):
        """(shard, local start, local stop) pieces of the global token range [start, stop)."""
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            lo = start - int(self.starts[k])
            hi = min(stop, int(self.starts[k + 1])) - int(self.starts[k])
            yield k, lo, hi
            start += hi - lo
            k += 1

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """int64 tokens [start, stop) and their document index relative to the first token."""
        tokens = np.empty(stop - start, dtype=np.int64)
        segs = np.empty(stop - start, dtype=np.int64)
        filled, seg0 = 0, 0
        for k, lo, hi in self._pieces(start, stop):
            tokens[filled : filled + hi - lo] = self._tokens[k].array[lo:hi]
            self._tokens[k].release(lo, hi)
            # document index = number of document ends at or before each token, from lo
            ends = self._ends[k].array
            # same dtype as the index: a mixed-type search would convert the whole index
            i0, i1 = np.searchsorted(ends, np.array([lo, hi - 1], dtype=ends.dtype), side="right")
            bumps = np.zeros(hi - lo, dtype=np.int64)
            inside = ends[i0:i1].astype(np.int64) - lo
            bumps[inside[inside < hi - lo]] = 1
            local = np.cumsum(bumps)
            segs[filled : filled + hi - lo] = local + seg0
            seg0 = int(local[-1]) + 1  # a shard always ends at a document end
            filled += hi - lo
        self._reads += 1
        if self._reads % 256 == 0:  # index pages touched by the binary searches
            for ends in self._ends:
                ends.release()
        return tokens, segs
