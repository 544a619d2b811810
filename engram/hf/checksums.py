"""checksums.sha256 of an exported folder: written by every export, verified by our readers.

The file is exactly `sha256sum`'s format ("<64 hex>  <name>" per line, names relative to the
folder), so a user checks a folder before serving it with `cd folder && sha256sum -c
checksums.sha256`. Our readers (the re-import in engram/hf/load.py, which generation and
evaluation use for model.hf_checkpoint, and load_engram_safetensors) call `verify_folder`: a
listed file that is missing or changed, or a model file the list does not cover, is refused by
name. A folder without the file (a download, another tool's export) is read with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger("engram")

CHECKSUMS_FILE = "checksums.sha256"
# Files a reader takes weights, shapes, config or code from: each must be covered by the list.
_READ_PATTERNS = ("*.safetensors", "*.json", "*.py", "*.bin")
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")
_CHUNK = 16 * 2**20
# (folder, file name) -> (size, mtime_ns) of a file already verified in this process, so a model
# loaded part by part (pipeline stages) hashes each file once.
_verified: dict[tuple[str, str], tuple[int, int]] = {}
_warned: set[str] = set()


class ChecksumError(ValueError):
    """A file of an exported folder is missing, changed or not covered by checksums.sha256."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_checksums(folder: str | Path, files: Iterable[str | Path]) -> Path:
    """Write `folder`/checksums.sha256 over `files` (paths in `folder`); returns its path."""
    folder = Path(folder)
    names = sorted({Path(f).name for f in files} - {CHECKSUMS_FILE})
    lines = [f"{sha256_file(folder / n)}  {n}\n" for n in names]
    out = folder / CHECKSUMS_FILE
    out.write_text("".join(lines))
    return out


def read_checksums(folder: Path) -> dict[str, str]:
    """name -> hex digest of `folder`/checksums.sha256 (ChecksumError on a malformed line)."""
    listed: dict[str, str] = {}
    for i, line in enumerate((folder / CHECKSUMS_FILE).read_text().splitlines(), 1):
        if not line.strip():
            continue
        m = _LINE.match(line)
        if m is None or "/" in m.group(2):
            raise ChecksumError(
                f"{folder / CHECKSUMS_FILE} line {i} is not '<64 hex digits>  <file name>': "
                f"{line[:80]!r}. The file is damaged: re-export the folder"
            )
        listed[m.group(2)] = m.group(1)
    return listed


def verify_folder(folder: str | Path) -> bool:
    """Check every file of `folder` against its checksums.sha256; returns whether the folder had
    one. Refuses (ChecksumError, naming the files) a listed file that is missing or whose
    content changed, and a weights / config / code file the list does not cover."""
    folder = Path(folder)
    if not (folder / CHECKSUMS_FILE).is_file():
        if str(folder) not in _warned:
            _warned.add(str(folder))
            logger.warning(
                "%s has no %s: its files cannot be checked for damage (fine for a download or "
                "another tool's export; scripts/export_hf.py writes one)", folder, CHECKSUMS_FILE,
            )  # fmt: skip
        return False
    listed = read_checksums(folder)
    missing = sorted(n for n in listed if not (folder / n).is_file())
    uncovered = sorted(
        {p.name for pat in _READ_PATTERNS for p in folder.glob(pat) if p.is_file()} - set(listed)
    )
    changed = []
    for name, digest in sorted(listed.items()):
        path = folder / name
        if name in missing:
            continue
        stat = path.stat()
        key, seen = (str(folder.resolve()), name), (stat.st_size, stat.st_mtime_ns)
        if _verified.get(key) == seen:
            continue
        if sha256_file(path) != digest:
            changed.append(name)
        else:
            _verified[key] = seen
    if missing or changed or uncovered:
        problems = [
            *(f"{n}: changed since export (sha256 differs)" for n in changed),
            *(f"{n}: listed but missing" for n in missing),
            *(f"{n}: not listed (added after export?)" for n in uncovered),
        ]
        raise ChecksumError(
            f"{folder} does not match its {CHECKSUMS_FILE}:\n  "
            + "\n  ".join(problems)
            + "\nThe folder is damaged or was edited: copy it again from the export, or "
            "re-export it (scripts/export_hf.py). `sha256sum -c checksums.sha256` in the folder "
            "shows the same"
        )
    return True
