"""Start-time refusals of the NVMe tier's settings, by name, before any page file is created.

`check_nvme_settings` runs on every rank before the model is materialised (runner/model_parts.py
build_model_parts): a setting that would put a shard's page files on the wrong disk, or fail
hours later, stops the run here with the setting and its fix. What it refuses:

- an engram.nvme_dirs entry that does not exist (a typo, an unmounted drive: the files would go
  to whatever disk holds the path), unless engram.nvme_create_dirs asks for it to be created and
  its parent (the drive's mount point) exists;
- an entry that is a file, or a directory this process cannot create files in;
- the same directory listed twice, also under another spelling (a trailing slash, `..`, a
  symlink: paths are compared resolved), which used to fail as a bare BlockingIOError;
- engram.nvme_host_cache_gib x the node's ranks above the host memory available.

That nvme_dirs / nvme_host_cache_gib / nvme_create_dirs are set only with table_location = "nvme"
is the config's check (engram/config/model.py Engram), for both recipes.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence

__all__ = ["check_nvme_settings"]

log = logging.getLogger(__name__)


class NvmeSettingError(ValueError):
    """An NVMe setting the run cannot start with; the message names the setting and the fix."""


def check_nvme_settings(
    dirs: Sequence[str],
    create_dirs: bool,
    host_cache_gib: float,
    ranks_per_node: int,
    host_available_bytes: int,
) -> list[str]:
    """Refuse what is listed in the module docstring, creating a missing directory first where
    `create_dirs` allows it. Returns the directories, resolved."""
    resolved: dict[str, str] = {}
    for d in dirs:
        real = os.path.realpath(d)
        if real in resolved:
            raise NvmeSettingError(
                f"engram.nvme_dirs lists the same directory twice: {resolved[real]!r} and {d!r} "
                f"are both {real}: list each drive's directory once"
            )
        resolved[real] = d
    for real, d in resolved.items():
        _check_directory(d, real, create_dirs)
    cache = host_cache_gib * 2**30 * ranks_per_node
    if cache > host_available_bytes:
        per_rank = host_available_bytes / ranks_per_node / 2**30
        raise NvmeSettingError(
            f"engram.nvme_host_cache_gib = {host_cache_gib:g} GiB per rank x {ranks_per_node} "
            f"rank(s) on this node is {cache / 2**30:.1f} GiB of host memory for the NVMe page "
            f"caches, but {host_available_bytes / 2**30:.1f} GiB are available (MemAvailable): "
            f"lower engram.nvme_host_cache_gib below {per_rank:.1f} (a step's pinned pages must "
            "fit: scripts/estimate_memory.py prints the least it needs)"
        )
    return list(resolved)


def _check_directory(d: str, real: str, create: bool) -> None:
    if os.path.exists(real) and not os.path.isdir(real):
        raise NvmeSettingError(
            f"engram.nvme_dirs entry {d!r} is a file, not a directory: point it at a directory "
            "on a local drive (one per drive)"
        )
    if not os.path.exists(real):
        parent = os.path.dirname(real)
        if not create:
            raise NvmeSettingError(
                f"engram.nvme_dirs entry {d!r} does not exist: a mistyped path or an unmounted "
                "drive would put the page files on whatever disk holds it. Create it (mkdir), "
                "fix the path, or set engram.nvme_create_dirs = true to have it created inside "
                "its existing parent"
            )
        if not os.path.isdir(parent):
            raise NvmeSettingError(
                f"engram.nvme_dirs entry {d!r} does not exist and neither does its parent "
                f"{parent} (an unmounted drive?): engram.nvme_create_dirs creates the entry "
                "only inside an existing directory; mount the drive or fix the path"
            )
        try:
            os.mkdir(real, 0o700)
            log.info("NVMe Engram tables: created %s (engram.nvme_create_dirs)", real)
        except FileExistsError:
            pass  # another rank of this node created it first
        except OSError as e:
            raise NvmeSettingError(
                f"engram.nvme_dirs entry {d!r}: cannot create it ({e.strerror}): create it by "
                "hand or fix the path"
            ) from e
    try:
        with tempfile.TemporaryFile(dir=real):
            pass
    except OSError as e:
        raise NvmeSettingError(
            f"engram.nvme_dirs entry {d!r} is not writable by this process ({e.strerror}): "
            "give the training user write access, or point it at a writable directory"
        ) from e
