"""Document sources: infinite, deterministic, indexable streams of document strings.

Every source maps a global document index i >= 0 to a string, so a loader can resume at any
document without replaying the ones before it. File datasets are read into memory once (in the
parent process, before loader workers fork) and re-shuffled every epoch with a seeded
permutation; the held-out split of a file dataset is ~1% of its documents, spread evenly and
excluded from the training split.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

import numpy as np

from engram.config import Data
from engram.data.synthetic import SPLITS, SyntheticFacts, part_entities

_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


class DocumentSource(Protocol):
    def __getitem__(self, index: int) -> str: ...


def _files(path: Path, suffix: str) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file())
        if not files:
            raise FileNotFoundError(
                f"no *{suffix} files under {path}: set data.path to a folder of them"
            )
        return files
    raise FileNotFoundError(f"data.path {path} does not exist: set data.path to a file or folder")


def read_text_documents(path: str | Path) -> list[str]:
    """A .txt file or a folder of .txt files (sorted, recursive); documents end at blank lines."""
    docs: list[str] = []
    for file in _files(Path(path), ".txt"):
        text = file.read_text(encoding="utf-8")
        docs.extend(d.strip() for d in _BLANK_LINE.split(text) if d.strip())
    return docs


def read_jsonl_documents(path: str | Path, field: str = "text") -> list[str]:
    """A .jsonl file or a folder of .jsonl files; one JSON object per line, text in `field`."""
    docs: list[str] = []
    for file in _files(Path(path), ".jsonl"):
        with file.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file}:{lineno}: invalid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or field not in obj:
                    raise ValueError(
                        f"{file}:{lineno}: no {field!r} field; every line must be a JSON object "
                        f'like {{"{field}": "..."}}'
                    )
                if not isinstance(obj[field], str):
                    raise ValueError(f"{file}:{lineno}: field {field!r} must be a string")
                if obj[field].strip():
                    docs.append(obj[field])
    return docs


def heldout_indices(num_docs: int) -> np.ndarray:
    """~1% of documents (at least one), evenly spread; none when there are fewer than 2."""
    if num_docs < 2:
        return np.zeros(0, dtype=np.int64)
    n_val = max(1, num_docs // 100)
    return ((np.arange(n_val) + 0.5) * num_docs / n_val).astype(np.int64)


class ShuffledDocuments:
    """Loops over a fixed document list, one seeded permutation per epoch."""

    def __init__(self, docs: list[str], seed: int, shuffle: bool = True) -> None:
        if not docs:
            raise ValueError("the dataset has no documents (all files empty?)")
        self.docs = docs
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._perm = np.arange(len(docs))

    def __getitem__(self, index: int) -> str:
        epoch, pos = divmod(index, len(self.docs))
        if self.shuffle and epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
            self._epoch = epoch
        return self.docs[int(self._perm[pos])]


def split_documents(docs: list[str], split: str) -> list[str]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    held = heldout_indices(len(docs))
    if split == "val":
        if len(held) == 0:
            raise ValueError(
                f"cannot hold out documents from a dataset of {len(docs)} document(s); "
                "add documents or set data.eval_batches = 0"
            )
        return [docs[i] for i in held]
    keep = np.ones(len(docs), dtype=bool)
    keep[held] = False
    return [d for d, k in zip(docs, keep, strict=True) if k]


def build_documents(data: Data, split: str, seed: int) -> DocumentSource:
    """The document stream of `data.dataset` for `split` ("train" or "val"); `seed` orders it."""
    if data.dataset == "synthetic_facts":
        n = data.synthetic_num_entities
        entities = part_entities(
            data.synthetic_seed, n, data.synthetic_part, data.synthetic_pretrain_fraction
        )
        return SyntheticFacts(data.synthetic_seed, n, seed, split, entities)
    if data.dataset == "text":
        docs = read_text_documents(data.path)
    elif data.dataset == "jsonl":
        docs = read_jsonl_documents(data.path)
    else:
        raise ValueError(
            f"unknown data.dataset {data.dataset!r} for a document stream: use synthetic_facts, "
            "text or jsonl"
        )
    return ShuffledDocuments(split_documents(docs, split), seed)
