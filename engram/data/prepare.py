"""Tokenise a corpus once, offline, into memory-mapped token shards (format: shards.py).

The plan is a pure function of the input files and --shard-mb: each shard is a list of byte
ranges of the inputs, cut at document boundaries found by seeking (no full pass). Worker
processes tokenise shards independently and stream tokens to disk, so memory stays bounded by a
tokenisation batch per worker whatever the corpus size. A shard is written to *.tmp files and
renamed into place, its header last: an interrupted prepare, rerun with the same command, keeps
the finished shards and redoes the rest. The same inputs give byte-identical outputs.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engram.data.shards import (
    FORMAT,
    MANIFEST,
    shard_name,
    token_dtype,
    tokenizer_fingerprint,
    write_json_atomic,
)
from engram.data.tokenizer import Tokenizer, load_tokenizer

SUFFIXES = {".jsonl": "jsonl", ".txt": "text"}
_BATCH_BYTES = 1 << 20  # text per encode_batch call: bounds a worker's memory


@dataclass(frozen=True)
class Options:
    tokenizer_path: str = ""
    text_field: str = "text"
    append_eos: bool = True
    prepend_bos: bool = False
    shard_bytes: int = 256 << 20
    workers: int = 1


def input_files(paths: list[str]) -> list[Path]:
    """Files (sorted, recursive for folders) with a .jsonl or .txt suffix."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
            if not found:
                raise FileNotFoundError(f"no .jsonl or .txt files under {p}")
            files += found
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise ValueError(
                    f"{p}: unknown input type; use .jsonl (one JSON object a line) or .txt"
                )
            files.append(p)
        else:
            raise FileNotFoundError(f"input {p} does not exist")
    return files


def _is_blank(line: bytes) -> bool:
    return not line.strip(b" \t\r\f\v\n")


def _boundary(path: Path, target: int, size: int) -> int:
    """First document start at or after byte `target` (a line start; for .txt, after a blank line)."""
    if target <= 0:
        return 0
    if target >= size:
        return size
    with path.open("rb") as f:
        f.seek(target - 1)
        f.readline()  # finish the line holding byte target-1
        if path.suffix == ".txt":
            while True:
                line = f.readline()
                if not line or _is_blank(line):
                    break
        return min(f.tell(), size)


def _row_group_bytes(path: Path) -> list[int]:
    import pyarrow.parquet as pq  # chat inputs only (prepare_sft.py)

    meta = pq.ParquetFile(path).metadata
    return [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]


def plan_shards(files: list[Path], shard_bytes: int) -> list[list[tuple[str, int, int]]]:
    """Shards as lists of (file, start, end), each ~shard_bytes of input: byte ranges of text
    files (cut at document starts), row-group ranges of .parquet files."""
    plan: list[list[tuple[str, int, int]]] = []
    job: list[tuple[str, int, int]] = []
    used = 0
    for path in files:
        if path.suffix == ".parquet":
            for g, size in enumerate(_row_group_bytes(path)):
                if job and job[-1][0] == str(path) and job[-1][2] == g:
                    job[-1] = (str(path), job[-1][1], g + 1)
                else:
                    job.append((str(path), g, g + 1))
                used += size
                if used >= shard_bytes:
                    plan.append(job)
                    job, used = [], 0
            continue
        size, pos = path.stat().st_size, 0
        while pos < size:
            cut = _boundary(path, pos + shard_bytes - used, size)
            if cut > pos:
                job.append((str(path), pos, cut))
                used += cut - pos
                pos = cut
            if used >= shard_bytes:
                plan.append(job)
                job, used = [], 0
    if job:
        plan.append(job)
    return plan


def segment_bytes(segment: tuple[str, int, int]) -> int:
    """Input bytes of a planned segment (progress accounting)."""
    name, start, end = segment
    if name.endswith(".parquet"):
        return sum(_row_group_bytes(Path(name))[start:end])
    return end - start


def plan_headers(
    files: list[Path], shard_bytes: int, common: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]:
    """(sources: path, bytes, sha256 of every input; shard headers: `common` plus the shard's
    segments and their files' sha256; input bytes of each shard)."""
    sources = [{"path": str(f), "bytes": f.stat().st_size, "sha256": file_sha256(f)} for f in files]
    sha = {s["path"]: s["sha256"] for s in sources}
    plan = plan_shards(files, shard_bytes)
    headers = [
        {**common, "segments": [list(s) for s in segs], "source_sha256": [sha[s[0]] for s in segs]}
        for segs in plan
    ]
    return sources, headers, [sum(segment_bytes(s) for s in segs) for segs in plan]


def manifest_tokenizer(tok: Tokenizer, path: str) -> dict[str, Any]:
    """The manifest's record of the tokenizer that prepared the shards."""
    return {
        "fingerprint": tokenizer_fingerprint(tok),
        "path": path,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
    }


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def iter_documents(segments: list[tuple[str, int, int]], text_field: str) -> Iterator[str]:
    """Documents of byte ranges: jsonl lines (the text field), or blank-line separated text."""
    for name, start, end in segments:
        path = Path(name)
        with path.open("rb") as f:
            f.seek(start)
            pos, lines = start, []
            while pos < end:
                line = f.readline()
                if not line:
                    break
                lineno_hint = f"{path} (byte {pos})"
                text = _utf8(line, path, pos)
                pos += len(line)
                if path.suffix == ".jsonl":
                    if not text.strip():
                        continue
                    text = _json_text(text, text_field, lineno_hint)
                    if text.strip():  # as the jsonl dataset: blank documents are skipped
                        yield text
                elif _is_blank(line):
                    if doc := "".join(lines).strip():
                        yield doc
                    lines = []
                else:
                    lines.append(text)
            if lines and (doc := "".join(lines).strip()):
                yield doc


def _utf8(line: bytes, path: Path, pos: int) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} (byte {pos + e.start}): not UTF-8 ({e.reason}). Convert the file to UTF-8, "
            f"e.g. iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}"
        ) from None


def _json_text(line: str, field: str, where: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
        raise ValueError(
            f"{where}: no string {field!r} field; every line must be a JSON object like "
            f'{{"{field}": "..."}} (or pass --text-field)'
        )
    return obj[field]


# ----------------------------------------------------------------------------- workers

_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _TOKENIZER = load_tokenizer(tokenizer_path)


def write_shard(out: Path, index: int, header: dict[str, Any], opts: Options) -> dict[str, Any]:
    """Tokenise one planned shard into out/shard_k.{bin,idx} and, last, its header json."""
    tok = _TOKENIZER if _TOKENIZER is not None else load_tokenizer(opts.tokenizer_path)
    dtype = np.dtype(header["dtype"])
    name = shard_name(index)
    tmp_bin, tmp_idx = out / f"{name}.bin.tmp", out / f"{name}.idx.tmp"
    digest = hashlib.sha256()
    ends: list[int] = []
    total, max_id = 0, -1
    prefix = [tok.bos_id] if opts.prepend_bos and tok.bos_id is not None else []
    suffix = [tok.eos_id] if opts.append_eos else []

    def flush(f, docs: list[str]) -> None:
        nonlocal total, max_id
        for enc in tok.hf.encode_batch(docs, add_special_tokens=False):
            ids = np.asarray(prefix + enc.ids + suffix, dtype=np.int64)
            if len(ids) == 0:
                continue
            max_id = max(max_id, int(ids.max()))
            data = ids.astype(dtype).tobytes()
            f.write(data)
            digest.update(data)
            total += len(ids)
            ends.append(total)

    try:
        with tmp_bin.open("wb") as f:
            batch: list[str] = []
            size = 0
            for doc in iter_documents(header["segments"], opts.text_field):
                batch.append(doc)
                size += len(doc)
                if size >= _BATCH_BYTES:
                    flush(f, batch)
                    batch, size = [], 0
            if batch:
                flush(f, batch)
    except BaseException:  # bad input or interrupted: no partial shard is left behind
        tmp_bin.unlink(missing_ok=True)
        raise
    np.asarray(ends, dtype="<u8").tofile(tmp_idx)
    os.replace(tmp_bin, out / f"{name}.bin")
    os.replace(tmp_idx, out / f"{name}.idx")
    done = {**header, "name": name, "tokens": total, "docs": len(ends), "max_token_id": max_id,
            "sha256": digest.hexdigest()}  # fmt: skip
    write_json_atomic(out / f"{name}.json", done)  # last: marks the shard finished
    return done


def _write_shard_job(args: tuple[Path, Options, int, dict[str, Any]]) -> dict[str, Any]:
    out, opts, index, header = args
    return write_shard(out, index, header, opts)


# ----------------------------------------------------------------------------- driver


def write_shards(
    out: Path,
    headers: list[dict[str, Any]],
    bytes_of: list[int],
    files: tuple[str, ...],
    job: Any,
    init: Any,
    init_args: tuple,
    job_args: tuple,
    workers: int,
    progress: bool,
) -> list[dict[str, Any]]:
    """Write the shards of `headers` not finished yet (a finished one: its header json matches
    and its `files` exist), `workers` processes at a time (each started by `init(*init_args)`,
    a shard written by `job((*job_args, index, header))`); the finished headers, in order."""
    done: dict[int, dict[str, Any]] = {}
    for i, header in enumerate(headers):
        path = out / f"{shard_name(i)}.json"
        if path.is_file():
            old = json.loads(path.read_text(encoding="utf-8"))
            if any(old.get(k) != v for k, v in header.items()):
                raise ValueError(
                    f"{path} was written by a prepare with other inputs, tokenizer or options: "
                    f"use a new --out folder, or delete {out} to start over"
                )
            if all((out / f"{shard_name(i)}{suffix}").is_file() for suffix in files):
                done[i] = old
    todo = [i for i in range(len(headers)) if i not in done]
    total_bytes = sum(bytes_of)
    seen = sum(bytes_of[i] for i in done)
    t0 = time.perf_counter()

    def report(final: bool = False) -> None:
        if not progress:
            return
        dt = max(time.perf_counter() - t0, 1e-9)
        sys.stderr.write(
            f"\rprepare: {len(done)}/{len(headers)} shards, {seen / 1e6:,.1f}/"
            f"{total_bytes / 1e6:,.1f} MB ({100 * seen / max(total_bytes, 1):.0f}%), "
            f"{seen / 1e6 / dt:.1f} MB/s" + ("\n" if final else "")
        )
        sys.stderr.flush()

    if done:
        report()
    jobs = [(*job_args, i, headers[i]) for i in todo]
    if workers > 1 and len(jobs) > 1:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(workers, init, init_args) as pool:
            for result in pool.imap_unordered(job, jobs):
                i = int(result["name"].split("_")[1])
                done[i], seen = result, seen + bytes_of[i]
                report()
    else:
        init(*init_args)
        for args in jobs:
            result = job(args)
            i = int(result["name"].split("_")[1])
            done[i], seen = result, seen + bytes_of[i]
            report()
    report(final=True)
    return [done[i] for i in range(len(headers))]


def prepare(inputs: list[str], out: str | Path, opts: Options, progress: bool = True) -> dict:
    """Prepare (or finish preparing) `inputs` into `out`; returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(opts.tokenizer_path)
    files = input_files(inputs)
    dtype = token_dtype(tok.vocab_size)
    common = {
        "format": FORMAT,
        "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "dtype": dtype.str,
        "text_field": opts.text_field,
        "append_eos": opts.append_eos,
        "prepend_bos": opts.prepend_bos,
    }
    sources, headers, bytes_of = plan_headers(files, opts.shard_bytes, common)
    shards = write_shards(
        out, headers, bytes_of, (".bin", ".idx"), _write_shard_job, _init_worker,
        (opts.tokenizer_path,), (out, opts), opts.workers, progress,
    )  # fmt: skip
    manifest = {
        "format": FORMAT,
        "tokenizer": manifest_tokenizer(tok, opts.tokenizer_path),
        "dtype": dtype.str,
        "text_field": opts.text_field,
        "append_eos": opts.append_eos,
        "prepend_bos": opts.prepend_bos,
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_docs": sum(s["docs"] for s in shards),
        "max_token_id": max((s["max_token_id"] for s in shards), default=-1),
        "sources": sources,
        "shards": [{k: s[k] for k in ("name", "tokens", "docs", "sha256")} for s in shards],
        "fingerprint": hashlib.sha256("".join(s["sha256"] for s in shards).encode()).hexdigest()[
            :16
        ],
    }
    write_json_atomic(out / MANIFEST, manifest)
    return manifest
