"""Tokenise a fine-tuning set once, offline, into chat shards (`prepare_data.py --chat`).

The shards are the plain token shards (shards.py: `.bin` ids, `.idx` uint64 end of every
conversation, `.json` header renamed into place last, `dataset.json` manifest) plus, per shard,
`.mask`: the target mask of its tokens as a bitmap (numpy packbits, little bit order, 1 = a
target under train_on = "assistant"; train_on = "all" ignores it at load). Manifest format
"engram-sft/1", read by `data.dataset = "chat"` with `data.path` = the folder (sft_shards.py).

Records are rendered and masked exactly as the on-the-fly chat dataset does (chat_encode.py),
in input order (files sorted, records in order), so the prepared folder holds the same
conversations with the same indices: the held-out split and the batches are the same. A record
without a target (no assistant turn, empty text) is skipped and counted in the manifest
(`skipped`, `skipped_first`). Shards are planned as byte ranges of .jsonl files (cut at line
starts) and row-group ranges of .parquet files, `--workers` processes write them, and an
interrupted prepare rerun with the same command keeps the finished shards (prepare.py's
`write_shards`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engram.data.chat_encode import ChatEncoder
from engram.data.chat_records import iter_jsonl, iter_parquet, parse_record, record_files
from engram.data.chat_template import load_chat_template
from engram.data.prepare import manifest_tokenizer, plan_headers, write_shards
from engram.data.shards import (
    MANIFEST,
    SFT_FORMAT,
    shard_name,
    token_dtype,
    tokenizer_fingerprint,
    write_json_atomic,
)
from engram.data.tokenizer import load_tokenizer

SHARD_FILES = (".bin", ".idx", ".mask")
_SHOW = 3


@dataclass(frozen=True)
class ChatOptions:
    tokenizer_path: str = ""
    chat_template: str = ""
    """A .jinja file or tokenizer_config.json (data.chat_template); empty: the tokenizer's."""
    chat_template_kwargs: str = ""
    """JSON object of extra template variables (data.chat_template_kwargs)."""
    shard_bytes: int = 256 << 20
    workers: int = 1


# ----------------------------------------------------------------------------- workers

_ENCODER: ChatEncoder | None = None


def _init_chat_worker(tokenizer_path: str, chat_template: str, kwargs: str) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(tokenizer_path)
    _ENCODER = ChatEncoder(tok, load_chat_template(tok, chat_template), json.loads(kwargs or "{}"))


def _records(segments: list[list]):
    for name, start, end in segments:
        path = Path(name)
        rows = (
            iter_parquet(path, start, end)
            if path.suffix == ".parquet"
            else iter_jsonl(path, start, end)
        )
        for where, obj in rows:
            yield parse_record(obj, where)


class _BitWriter:
    """Appends bool arrays to a file as packed bits (little bit order), carrying the remainder."""

    def __init__(self, f) -> None:
        self.f = f
        self.carry = np.zeros(0, dtype=bool)

    def write(self, bits: np.ndarray) -> bytes:
        bits = np.concatenate([self.carry, bits])
        whole = len(bits) // 8 * 8
        data = np.packbits(bits[:whole], bitorder="little").tobytes()
        self.carry = bits[whole:]
        self.f.write(data)
        return data

    def close(self) -> bytes:
        data = np.packbits(self.carry, bitorder="little").tobytes() if len(self.carry) else b""
        self.f.write(data)
        return data


def write_chat_shard(out: Path, index: int, header: dict[str, Any]) -> dict[str, Any]:
    """Render, tokenise and mask one planned shard into out/shard_k.{bin,idx,mask}, then its
    header json (last: marks it finished)."""
    assert _ENCODER is not None, "call _init_chat_worker first"
    dtype = np.dtype(header["dtype"])
    name = shard_name(index)
    tmp = {s: out / f"{name}{s}.tmp" for s in SHARD_FILES}
    digest = hashlib.sha256()
    ends: list[int] = []
    skipped: list[str] = []
    total = targets = 0
    max_id = -1
    try:
        with tmp[".bin"].open("wb") as fb, tmp[".mask"].open("wb") as fm:
            bits = _BitWriter(fm)
            for rec in _records(header["segments"]):
                enc = _ENCODER.encode(rec)
                if enc is None:
                    skipped.append(rec.where)
                    continue
                ids, mask = enc
                data = ids.astype(dtype).tobytes()
                fb.write(data)
                digest.update(data)
                digest.update(bits.write(mask))
                max_id = max(max_id, int(ids.max()))
                total += len(ids)
                targets += int(mask.sum())
                ends.append(total)
            digest.update(bits.close())
    except BaseException:  # bad input or interrupted: no partial shard is left behind
        for path in tmp.values():
            path.unlink(missing_ok=True)
        raise
    np.asarray(ends, dtype="<u8").tofile(tmp[".idx"])
    for suffix, path in tmp.items():
        os.replace(path, out / f"{name}{suffix}")
    done = {**header, "name": name, "tokens": total, "conversations": len(ends),
            "targets": targets, "skipped": len(skipped), "skipped_first": skipped[:_SHOW],
            "max_token_id": max_id, "sha256": digest.hexdigest()}  # fmt: skip
    write_json_atomic(out / f"{name}.json", done)
    return done


def _write_chat_job(args: tuple[Path, int, dict[str, Any]]) -> dict[str, Any]:
    return write_chat_shard(*args)


# ----------------------------------------------------------------------------- driver


def prepare_chat(
    inputs: list[str], out: str | Path, opts: ChatOptions, progress: bool = True
) -> dict[str, Any]:
    """Prepare (or finish preparing) the chat records of `inputs` into `out`; the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(opts.tokenizer_path)
    template = load_chat_template(tok, opts.chat_template)
    kwargs = json.loads(opts.chat_template_kwargs or "{}")
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object {...}")
    files = [f for p in inputs for f in record_files(p)]
    dtype = token_dtype(tok.vocab_size)
    common = {
        "format": SFT_FORMAT,
        "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "dtype": dtype.str,
        "chat_template_sha256": None if template is None else template.sha256,
        "chat_template_kwargs": kwargs,
    }
    sources, headers, bytes_of = plan_headers(files, opts.shard_bytes, common)
    init_args = (opts.tokenizer_path, opts.chat_template, json.dumps(kwargs))
    shards = write_shards(
        out, headers, bytes_of, SHARD_FILES, _write_chat_job, _init_chat_worker, init_args,
        (out,), opts.workers, progress,
    )  # fmt: skip
    skipped_first = [w for s in shards for w in s["skipped_first"]][:_SHOW]
    manifest = {
        "format": SFT_FORMAT,
        "tokenizer": {**manifest_tokenizer(tok, opts.tokenizer_path), "pad_id": tok.pad_id},
        "chat_template": None
        if template is None
        else {"sha256": template.sha256, "origin": template.origin},
        "chat_template_kwargs": kwargs,
        "dtype": dtype.str,
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_conversations": sum(s["conversations"] for s in shards),
        "num_targets": sum(s["targets"] for s in shards),
        "skipped": sum(s["skipped"] for s in shards),
        "skipped_first": skipped_first,
        "max_token_id": max((s["max_token_id"] for s in shards), default=-1),
        "sources": sources,
        "shards": [
            {k: s[k] for k in ("name", "tokens", "conversations", "sha256")} for s in shards
        ],
        "fingerprint": hashlib.sha256("".join(s["sha256"] for s in shards).encode()).hexdigest()[
            :16
        ],
    }
    write_json_atomic(out / MANIFEST, manifest)
    return manifest
