"""Fine-tuning records from .jsonl and .parquet files: read, checked, named by where they are.

A record is one of (the names TRL's SFTTrainer reads):

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": ...}, ...]}
        a conversation rendered with the chat template; its assistant turns are the targets
    {"prompt": [messages], "completion": [messages]}
        a conversation; the assistant turns of the completion are the targets
    {"prompt": "...", "completion": "..."}
        plain text, no template: the completion (and the eos after it) is the target
    {"text": "..."}
        plain text, no template: every token is a target

plus optional "tools" (a list of JSON schemas, or that list as a JSON string) and
"chat_template_kwargs" (extra template variables) for conversations. A .jsonl file holds one
record a line (blank lines skipped). A .parquet file is read one row group at a time
(`ParquetFile.read_row_group`, never whole) from the columns of the first of these forms its
schema has. Anything else is an error naming the file and line (or row group and row) and the
fix; nothing is silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
SUFFIXES = (".jsonl", ".parquet")
FORMS = (
    'one JSON object per record: {"messages": [{"role": ..., "content": ...}, ...]}, '
    '{"prompt": ..., "completion": ...} or {"text": ...}'
)
_OPTIONAL = ("tools", "chat_template_kwargs")


class RecordError(ValueError):
    """A record that is not one of the accepted forms; the message names where and the fix."""


@dataclass(frozen=True)
class Conversation:
    """Messages rendered with the chat template; assistant turns at index >= first_target are
    targets (0 for `messages`, len(prompt) for a conversational prompt / completion)."""

    where: str
    messages: list[dict[str, Any]]
    first_target: int = 0
    tools: list[dict[str, Any]] | None = None
    kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class PlainText:
    """Text without a template: the prompt is context, the completion the target."""

    where: str
    prompt: str
    completion: str


Record = Conversation | PlainText


def _messages(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RecordError(
            f"{where}: {key!r} must be a non-empty list of messages "
            f'[{{"role": "user", "content": "..."}}, ...], got {str(value)[:60]!r}'
        )
    out = []
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            raise RecordError(f"{where}: {key}[{j}] is not an object {{role, content}}")
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if role is None:
            raise RecordError(
                f"{where}: {key}[{j}] has no 'role': every message needs a role "
                f"({', '.join(ROLES)}) and its content"
            )
        if role not in ROLES:
            hint = (
                " (ShareGPT names: human -> user, gpt -> assistant)"
                if role in ("human", "gpt")
                else ""
            )
            raise RecordError(
                f"{where}: {key}[{j}] has the unknown role {role!r}: use one of "
                f"{', '.join(ROLES)}{hint}"
            )
        if "content" not in message and not (role == "assistant" and "tool_calls" in message):
            raise RecordError(
                f"{where}: {key}[{j}] ({role}) has no 'content' (only an assistant message with "
                "tool_calls may omit it)"
            )
        out.append(message)
    return out


def parse_record(obj: Any, where: str) -> Record:
    """One record -> a Conversation or PlainText; RecordError names `where` and the fix."""
    if not isinstance(obj, dict):
        raise RecordError(f"{where}: not a JSON object; {FORMS}")
    obj = {k: v for k, v in obj.items() if v is not None}  # parquet fills absent columns
    tools = obj.get("tools")
    if isinstance(tools, str):  # as TRL: tools stored as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise RecordError(f"{where}: 'tools' is a string but not JSON ({e.msg})") from None
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise RecordError(f"{where}: 'tools' must be a list of JSON schemas (objects)")
    kwargs = obj.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RecordError(f"{where}: 'chat_template_kwargs' must be an object")
    if "messages" in obj:
        return Conversation(where, _messages(obj["messages"], where, "messages"), 0, tools, kwargs)
    if "prompt" in obj or "completion" in obj:
        present, missing = ("prompt", "completion") if "prompt" in obj else ("completion", "prompt")
        if missing not in obj:
            raise RecordError(f"{where}: a record with {present!r} needs {missing!r} too; {FORMS}")
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return PlainText(where, prompt, completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            head = _messages(prompt, where, "prompt")
            tail = _messages(completion, where, "completion")
            return Conversation(where, head + tail, len(head), tools, kwargs)
        raise RecordError(
            f"{where}: 'prompt' and 'completion' must both be strings (plain text) or both lists "
            f"of messages (a conversation), got {type(prompt).__name__} and "
            f"{type(completion).__name__}"
        )
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise RecordError(f"{where}: 'text' must be a string")
        return PlainText(where, "", obj["text"])
    raise RecordError(
        f"{where}: no 'messages', 'prompt' + 'completion' or 'text' (keys: "
        f"{', '.join(sorted(obj)) or 'none'}); {FORMS}"
    )


def record_files(path: str | Path) -> list[Path]:
    """A .jsonl / .parquet file, or the ones under a folder (sorted, recursive)."""
    path = Path(path)
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise FileNotFoundError(
                f"{path}: a chat dataset reads .jsonl or .parquet files; convert it or point "
                "data.path at a folder of them"
            )
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise FileNotFoundError(
                f"no .jsonl or .parquet files under {path}: set data.path to a folder of them"
            )
        return files
    raise FileNotFoundError(f"data.path {path} does not exist: set it to a file or folder")


def iter_jsonl(path: Path, start: int = 0, end: int | None = None) -> Iterator[tuple[str, Any]]:
    """(where, object) of the lines of a .jsonl file; `where` is path:line from the start of the
    file, path (byte N) for a byte range that starts inside it (prepare's shards)."""
    with path.open("rb") as f:
        f.seek(start)
        pos, lineno = start, 1
        while end is None or pos < end:
            line = f.readline()
            if not line:
                break
            where = f"{path}:{lineno}" if start == 0 else f"{path} (byte {pos})"
            pos += len(line)
            lineno += 1
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RecordError(
                    f"{where}: not UTF-8 ({e.reason}); convert the file, e.g. "
                    f"iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}"
                ) from None
            if not text.strip():
                continue
            try:
                yield where, json.loads(text)
            except json.JSONDecodeError as e:
                raise RecordError(
                    f"{where}: not JSON ({e.msg} at column {e.colno}); a .jsonl file holds "
                    f"{FORMS}, one a line"
                ) from None


def parquet_columns(path: Path, names: list[str]) -> list[str]:
    """The columns to read: those of the first form the schema holds, plus tools/kwargs."""
    if "messages" in names:
        cols = ["messages"]
    elif "prompt" in names and "completion" in names:
        cols = ["prompt", "completion"]
    elif "text" in names:
        cols = ["text"]
    else:
        raise RecordError(
            f"{path}: no 'messages' column, 'prompt' + 'completion' columns or 'text' column "
            f"(its columns: {', '.join(names)}): rename the column that holds the "
            "conversations (e.g. conversations -> messages)"
        )
    return cols + [c for c in _OPTIONAL if c in names]


def parquet_row_groups(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).num_row_groups


def iter_parquet(
    path: Path, first_group: int = 0, last_group: int | None = None
) -> Iterator[tuple[str, Any]]:
    """(where, row dict) of row groups [first_group, last_group) of a .parquet file, one row
    group in memory at a time."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged file
        raise RecordError(f"{path}: cannot be read as parquet ({e})") from None
    cols = parquet_columns(path, pf.schema_arrow.names)
    stop = pf.num_row_groups if last_group is None else last_group
    for group in range(first_group, stop):
        rows = pf.read_row_group(group, columns=cols).to_pylist()
        for r, row in enumerate(rows):
            yield f"{path} (row group {group}, row {r})", row


def iter_records(path: Path) -> Iterator[Record]:
    """The checked records of one file, in order."""
    rows = iter_parquet(path) if path.suffix == ".parquet" else iter_jsonl(path)
    for where, obj in rows:
        yield parse_record(obj, where)


def read_records(path: str | Path) -> list[Record]:
    """Every record of a file or folder (small sets: held in memory)."""
    return [rec for file in record_files(path) for rec in iter_records(file)]
