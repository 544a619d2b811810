"""The fine-tuning datasets: `data.dataset = "chat"` (records on disk, or a prepared chat
folder) and `"synthetic_chat"` (generated QA about the synthetic facts) -> SftSamples.

Records on disk are read and encoded in every loader process at start (small sets; the start-up
line says how many), a prepared folder is mapped (any size: prepare once with
`scripts/prepare_data.py --chat`). Both hold the kept conversations in input order, and the
held-out split ("val") is the same ~1% of them, spread evenly (datasets.heldout_indices), so an
on-the-fly set and its prepared folder give the same batches. synthetic_chat has its own split
(held-out question phrasings, synthetic_chat.py).

The encoded table and each split's packing plan are built once per process and kept (a fresh
held-out loader per evaluation reuses them).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from engram.config import JobConfig
from engram.data.chat_encode import ChatEncoder, encode_records
from engram.data.chat_records import read_records, record_files
from engram.data.chat_template import load_chat_template
from engram.data.datasets import heldout_indices
from engram.data.prepare import file_sha256
from engram.data.sft import ConversationArrays, SftSamples
from engram.data.sft_shards import SftShards, is_prepared
from engram.data.shards import SFT_FORMAT, read_manifest
from engram.data.synthetic_chat import synthetic_chat_records
from engram.data.tokenizer import Tokenizer

logger = logging.getLogger("engram")
_CACHE: dict[tuple, Any] = {}
_CACHE_LIMIT = 8


def _cached(key: tuple, build):
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = build()
    return _CACHE[key]


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _encode(encoder: ChatEncoder, records: list, fingerprint: str):
    ids, masks, where, skipped = encode_records(encoder, records)
    return ConversationArrays(ids, masks, where, fingerprint), skipped


def _table(job_cfg: JobConfig, tokenizer: Tokenizer, split: str):
    """(conversation table, the indices of `split` in it, locations skipped without targets)."""
    data = job_cfg.data
    template = load_chat_template(tokenizer, data.chat_template)
    kwargs = data.chat_kwargs()
    if template is not None and "strftime_now" in template.source and not kwargs:
        logger.warning(
            f"the chat template {template.origin} calls strftime_now: what it renders (e.g. a "
            "'Today Date' line) changes with the day, and so the data. Fix it with "
            'data.chat_template_kwargs, e.g. \'{"date_string": "26 Jul 2024"}\' for Llama 3'
        )
    tsha = None if template is None else template.sha256
    if data.dataset == "synthetic_chat":
        args = (
            data.synthetic_seed,
            data.synthetic_num_entities,
            data.synthetic_part,
            data.synthetic_pretrain_fraction,
            split,
        )
        fp = _digest("synthetic_chat", *args, tokenizer.fingerprint, tsha, kwargs)
        table, skipped = _cached(
            ("encoded", fp),
            lambda: _encode(
                ChatEncoder(tokenizer, template, kwargs), synthetic_chat_records(*args), fp
            ),
        )
        return table, np.arange(len(table.lengths)), skipped
    if is_prepared(data.path):
        manifest = read_manifest(Path(data.path), SFT_FORMAT)
        table = _cached(
            (
                "prepared",
                str(Path(data.path).resolve()),
                manifest["fingerprint"],
                tsha,
                _digest(kwargs),
            ),
            lambda: SftShards(data.path, tokenizer.fingerprint, tokenizer.vocab_size, tsha, kwargs),
        )
        # the manifest names the first few skipped records: pad to the count
        skipped = list(table.manifest["skipped_first"])
        skipped += ["..."] * (table.manifest["skipped"] - len(skipped))
    else:
        files = record_files(data.path)
        shas = [file_sha256(f) for f in files]
        fp = _digest("chat", shas, tokenizer.fingerprint, tsha, kwargs)
        table, skipped = _cached(
            ("encoded", fp),
            lambda: _encode(ChatEncoder(tokenizer, template, kwargs), read_records(data.path), fp),
        )
    n = len(table.lengths)
    held = heldout_indices(n)
    if split == "val":
        if len(held) == 0:
            raise ValueError(
                f"cannot hold out conversations from {data.path}: it has {n}; add conversations "
                "or set data.eval_batches = 0"
            )
        return table, held, skipped
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    return table, np.nonzero(keep)[0], skipped


def split_locations(job_cfg: JobConfig, tokenizer: Tokenizer, split: str) -> list[str]:
    """Where each conversation of `split` came from (file:line, or parquet row group and row),
    in input order: the records a held-out evaluation asks (engram/inference/qa.py)."""
    table, members, _ = _table(job_cfg, tokenizer, split)
    return [table.where(int(i)) for i in members]


def build_chat_samples(job_cfg: JobConfig, tokenizer: Tokenizer, split: str) -> SftSamples:
    """The samples of one split of a chat / synthetic_chat dataset (cached per process)."""
    if split not in ("train", "val"):
        raise ValueError(f"unknown split {split!r}; valid splits: train, val")
    data, seq_len, seed = job_cfg.data, job_cfg.training.seq_len, job_cfg.job.seed
    table, members, skipped = _table(job_cfg, tokenizer, split)
    options = (data.pack, data.overflow, data.train_on, tokenizer.pad_id)
    return _cached(
        ("samples", table.fingerprint, seq_len, seed, split, options),
        lambda: SftSamples(
            table,
            members,
            seq_len,
            pack=data.pack,
            overflow=data.overflow,
            train_on=data.train_on,
            seed=seed,
            split=split,
            pad_id=tokenizer.pad_id,
            skipped=skipped,
            name=data.dataset if data.dataset == "synthetic_chat" else f"chat {data.path}",
        ),
    )
