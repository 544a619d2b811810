"""Which file system a path lives on (/proc/mounts), and whether that is a drive at all.

NVMe table pages and drive probes only mean something on a local drive: on tmpfs the "page
files" sit in host memory (the cache in front of them is then a second copy, and a probe times
memory), on a network file system every page read crosses the network. `storage_warning` says
so, naming the directory and its file system; start-up logs it (the run goes on: a small run
on tmpfs is a legitimate test).
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

__all__ = [
    "MEMORY_FS", "NETWORK_FS", "Mount", "disk_bytes", "existing_parent", "free_bytes", "mount_of",
    "size_text", "storage_warning",
]  # fmt: skip

MEMORY_FS = frozenset({"tmpfs", "ramfs"})
NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "fuse.glusterfs", "lustre",
    "gpfs", "9p", "afs", "beegfs", "wekafs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse",
    "fuse.juicefs", "fuse.cephfs",
})  # fmt: skip

_ESCAPE = re.compile(r"\\([0-7]{3})")  # /proc/mounts writes a space as \040


class Mount(NamedTuple):
    """Where a path lives: its mount point, file system type and source (device or server)."""

    point: str
    fstype: str
    source: str


def size_text(n: float) -> str:
    """`n` bytes for a message: GiB from 1 GiB up, else MiB or KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def existing_parent(path: str) -> str:
    """`path`, or its nearest parent that exists (a directory a run will create)."""
    path = os.path.realpath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system of `path` (statvfs)."""
    st = os.statvfs(existing_parent(path))
    return st.f_bavail * st.f_frsize


def disk_bytes(path: str) -> int:
    """Size of the file system of `path` (statvfs)."""
    st = os.statvfs(existing_parent(path))
    return st.f_blocks * st.f_frsize


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str, mounts_file: str = "/proc/mounts") -> Mount | None:
    """The mount holding `path` (symlinks resolved; it need not exist yet): the longest mount
    point that prefixes it; None where /proc/mounts cannot be read."""
    path = os.path.realpath(path)
    try:
        with open(mounts_file) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: Mount | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        source, point, fstype = _unescape(fields[0]), _unescape(fields[1]), fields[2]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, fstype, source)  # a later mount over the same point wins
    return best


def storage_warning(path: str, what: str = "engram.nvme_dirs entry") -> str | None:
    """A warning when `path` is not on a local drive (tmpfs / ramfs, or a network file
    system), else None."""
    mount = mount_of(path)
    if mount is None:
        return None
    if mount.fstype in MEMORY_FS:
        return (
            f"{what} {path} is on {mount.fstype} ({mount.point}): its page files live in host "
            "memory, not on a drive (the host cache is then a second copy, and no drive's speed "
            "is measured): point it at a local NVMe drive"
        )
    if mount.fstype in NETWORK_FS or mount.fstype.startswith("nfs"):
        return (
            f"{what} {path} is on the network file system {mount.fstype} ({mount.source} at "
            f"{mount.point}): every page read crosses the network: point it at a local NVMe drive"
        )
    return None
