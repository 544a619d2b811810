"""The NVMe row store's page files: naming, opening (O_DIRECT where allowed), ownership locks,
preallocation, the sweep of files left by dead runs, and I/O errors that name the fix.

Ownership. A store holds an exclusive `flock` on each of its files for as long as it has them
open; the kernel drops it when the process ends, however it ends (kill -9 included). Files are
named `<name>.pid<pid>.rank<rank>.pages`. Before a store creates its file in a directory it
takes the directory's lock (`.engram-pages.lock`, held for the create-and-lock only, so no sweep
can fall between a file's creation and its lock) and removes every file of that naming whose
lock it can take: such a file belongs to no live process (a run killed before its atexit
removal). A live run's files are locked and stay. `flock` is advisory and local to the machine:
several machines must not share an engram.nvme_dirs directory (it is meant for local drives).

Dead runs' files. A run removes its files when it exits; a killed one (kill -9, a node's crash)
leaves them, a whole shard per rank. The next store that creates a file in the directory sweeps
them and logs how many GiB it removed and which process (pid, rank, last write) left them;
`scripts/page_files.py list|remove DIR...` lists and removes them by hand, under the same lock
(`dead_page_files`, `remove_dead_page_files`), never touching a live run's files.

Preallocation. The file's full size is allocated at creation (`posix_fallocate`): a drive that
cannot hold the shard fails the run at start, naming the fix, instead of an ENOSPC hours later
mid-write-back (measured on this machine's ext4 disk: 1 ms per GiB, 0.003 s for 4 GiB; random
4 KiB O_DIRECT writes cost the same into allocated and sparse files). File systems without
fallocate get glibc's emulation, which writes one byte per block (slow for large files).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = [
    "DeadPageFile", "create_page_file", "dead_page_file_bytes", "dead_page_files", "page_io_error",
    "remove_dead_page_files", "sweep_dead_page_files",
]  # fmt: skip

log = logging.getLogger(__name__)

_PAGE_FILE = re.compile(r"\.pid(\d+)\.rank(\d+)\.pages$")
_DIR_LOCK = ".engram-pages.lock"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_FIX_SPACE = (
    "free space on that drive, point engram.nvme_dirs at drives with room, or check the plan "
    "(scripts/estimate_memory.py compares the page files with the drives' capacity)"
)


def _open(path: str, direct: bool) -> tuple[int, str | None]:
    """(fd, why O_DIRECT is off or None). Truncated: a store's new file reads as zeros
    (page_io.py reads nothing of a page it never wrote)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), None
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            reason = f"{path}: the file system refuses O_DIRECT ({e.strerror})"
            return os.open(path, flags, 0o600), reason
    return os.open(path, flags, 0o600), "O_DIRECT not requested" if not direct else "no O_DIRECT"


@contextmanager
def _directory_locked(folder: str):
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            errno.ENOENT,
            f"NVMe Engram table: page-file directory {folder} does not exist (engram.nvme_dirs: "
            "create it, fix the path, or set engram.nvme_create_dirs = true)",
        )
    fd = os.open(os.path.join(folder, _DIR_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


@dataclass(frozen=True)
class DeadPageFile:
    """A page file no live process holds: what a run killed before its exit removal left."""

    path: str
    bytes: int  # allocated on disk
    pid: int  # the process that wrote it (its name says)
    rank: int
    last_written: float  # mtime, seconds since the epoch

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.last_written))
        return f"pid {self.pid}, rank {self.rank}, last written {when}"


def _dead_files(folder: str, remove: bool) -> list[DeadPageFile]:
    """The page files in `folder` whose lock can be taken (no live process holds them),
    removed if `remove`. The caller holds the directory's lock (no store is between creating
    its file and locking it)."""
    dead = []
    for entry in sorted(os.listdir(folder)):
        named = _PAGE_FILE.search(entry)
        if not named:
            continue
        path = os.path.join(folder, entry)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # a live store's file
            continue
        try:
            st = os.fstat(fd)
            if remove:
                os.unlink(path)
        finally:
            os.close(fd)  # drops the probe's lock
        pid, rank = map(int, named.groups())
        dead.append(DeadPageFile(path, st.st_blocks * 512, pid, rank, st.st_mtime))
    return dead


def dead_page_files(folder: str) -> list[DeadPageFile]:
    """The page files in `folder` that no live process holds (listed under its lock)."""
    with _directory_locked(folder):
        return _dead_files(folder, remove=False)


def remove_dead_page_files(folder: str) -> list[DeadPageFile]:
    """Remove the page files in `folder` that no live process holds (under its lock; a live
    run's files stay); returns what was removed."""
    with _directory_locked(folder):
        return _dead_files(folder, remove=True)


def sweep_dead_page_files(folder: str) -> list[DeadPageFile]:
    """Remove the page files in `folder` that no live process holds (the caller holds the
    directory's lock) and log, per process that left them, how many GiB and which run."""
    removed = _dead_files(folder, remove=True)
    by_run: dict[tuple[int, int], list[DeadPageFile]] = {}
    for f in removed:
        by_run.setdefault((f.pid, f.rank), []).append(f)
    for files in by_run.values():
        log.warning(
            "NVMe Engram table: removed %d page file(s), %.3f GiB, from %s, left by a run that "
            "ended without removing them (%s; killed?): %s",
            len(files), sum(f.bytes for f in files) / 2**30, folder,
            max(files, key=lambda f: f.last_written).describe(),
            ", ".join(os.path.basename(f.path) for f in files),
        )  # fmt: skip
    return removed


def dead_page_file_bytes(folder: str) -> int:
    """Bytes on disk of the page files in `folder` that no live process holds: the next
    store's sweep frees them (start-up counts them as free space)."""
    return sum(f.bytes for f in dead_page_files(folder)) if os.path.isdir(folder) else 0


def create_page_file(
    folder: str, name: str, size: int, direct: bool
) -> tuple[int, str, str | None]:
    """(fd, path, why O_DIRECT is off or None) of a new page file of `size` bytes for `name`,
    locked by this process and allocated on the drive, after sweeping dead runs' files.
    `folder` must exist (check_nvme_settings creates it at start when asked)."""
    path = os.path.join(folder, f"{name}.pid{os.getpid()}.rank{_rank()}.pages")
    with _directory_locked(folder):
        sweep_dead_page_files(folder)
        fd, reason = _open(path, direct)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        os.ftruncate(fd, size)
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        if e.errno in _NO_SPACE:
            free = os.statvfs(folder)
            raise OSError(
                e.errno,
                f"NVMe Engram table: {path} needs {size} B but its drive has "
                f"{free.f_bavail * free.f_frsize} B free: {_FIX_SPACE}",
            ) from e
        raise
    return fd, path, reason


def page_io_error(e: OSError, path: str, write: bool) -> OSError:
    """`e` (from a page read or write-back of `path`) as an error that names the fix."""
    what = "writing a page back to" if write else "reading a page of"
    if e.errno in _NO_SPACE:
        fix = _FIX_SPACE
    else:
        fix = "check the drive (dmesg, smartctl)"
    return OSError(
        e.errno,
        f"NVMe Engram table: {e.strerror} {what} {path}: {fix}. The page files are scratch: "
        "resume from the last checkpoint (rows updated since it are lost with this run).",
    )


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
