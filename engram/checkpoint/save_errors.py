"""What a failed save reports: the step folder, the cause and, for a full disk, the free space
and what the previous checkpoint took (torch's writers often hide ENOSPC behind another error)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from engram.checkpoint.errors import CheckpointError
from engram.checkpoint.folder import read_manifest, step_folders


def _is_no_space(exc: BaseException) -> bool:
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        stack += [e.__cause__, e.__context__]
    text = str(exc)
    return "No space left" in text or "Disk quota exceeded" in text


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def space_left(folder: Path) -> tuple[int | None, int | None]:
    """(bytes free on checkpoint folder `folder`'s filesystem, bytes its newest committed
    checkpoint takes: about what a save needs); None where unknown."""
    where = folder if folder.is_dir() else folder.parent
    try:
        free: int | None = shutil.disk_usage(where).free
    except OSError:
        free = None
    need = None
    for step in reversed(step_folders(folder)):
        try:
            need = sum(f["size"] for f in read_manifest(folder / f"step-{step}")["files"].values())
            break
        except (CheckpointError, KeyError, TypeError):
            continue
    return free, need


def _written(tmp: Path) -> int:
    """Bytes in the partial save `tmp` (0 when it is gone or unreadable)."""
    try:
        return sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
    except OSError:
        return 0


def describe_save_error(folder: Path, step: int, tmp: Path, e: BaseException) -> str:
    """The message for save `step` into `tmp` (in checkpoint folder `folder`) failing with `e`.
    Call it before the partial save `tmp` is removed: that frees the space a full disk lacked."""
    # A full disk often surfaces as another error (torch's zip writer: "file write failed" or
    # "unexpected pos 704 vs 598"): the free space decides, not only the exception's errno.
    free, need = space_left(folder)
    full = free is not None and free < (need if need is not None else 1 << 20)
    if _is_no_space(e) or full:
        sizes = f"{_mib(free)} free" if free is not None else "free space unknown"
        if need is not None:
            sizes += f", the previous checkpoint took {_mib(need)}"
        written = _written(tmp)
        if written:
            sizes += f", this save needed more than the {_mib(written)} it had written"
        first = (str(e).strip().splitlines() or [""])[0][:160]
        what = f"no space left on the device ({sizes}; {type(e).__name__}: {first})"
    else:
        what = f"{type(e).__name__}: {e}"
    return (
        f"saving checkpoint step-{step} into {tmp} failed: {what}. Previous checkpoints "
        f"in {folder} are untouched. Free space (or lower checkpoint.keep_latest_k), "
        "or point job.dump_folder / checkpoint.folder at a writable filesystem"
    )
