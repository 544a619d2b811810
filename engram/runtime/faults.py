"""Deterministic fault injection: a test hook, off unless ENGRAM_FAULTS is set.

    ENGRAM_FAULTS="nvme.page_write:40:kill" ./run_train.sh ...

Each comma-separated entry is `point:n:action[:rank[:attempt]]`: the n-th time this process
passes `point(name)` (counted from 1, over every thread), it takes `action`:

- `kill`: SIGKILL itself (kill -9: no atexit, no flush, no cleanup; what a crash or the OOM
  killer does);
- `enospc` / `eio`: raise OSError(ENOSPC) / OSError(EIO), as a full or failing drive does;
- `count`: nothing (n is ignored): the point only counts, for `hits` (a test reads where a
  later run should fail, off a run that did not).

`rank` (the RANK variable; default any) and `attempt` (torchrun's TORCHELASTIC_RESTART_COUNT;
default 0, so a restarted job runs clean) pick the process. Counts are per process and
deterministic where the call order is (the points sit on sequential paths: a page write-back
batch runs after the previous one finished).

Points (grep `faults.point(`): `nvme.page_write`, after each page an NVMe row store wrote back
(engram/rowstore/page_io.py).

With ENGRAM_FAULTS unset `point` is one dict lookup that finds nothing: nothing to pay on the
paths it sits on.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading

__all__ = ["armed", "configure", "hits", "point"]

_ACTIONS = ("kill", "enospc", "eio", "count")
_armed: dict[str, tuple[int, str]] = {}  # point -> (n, action), for this process only
_hits: dict[str, int] = {}
_lock = threading.Lock()


def configure(spec: str | None = None) -> None:
    """(Re)read the faults of this process from `spec` (default: $ENGRAM_FAULTS); counts restart."""
    spec = os.environ.get("ENGRAM_FAULTS", "") if spec is None else spec
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    armed = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":")
        if len(parts) not in (3, 4, 5) or parts[2] not in _ACTIONS or not parts[1].isdigit():
            raise ValueError(
                f"ENGRAM_FAULTS entry {entry!r}: expected point:n:action[:rank[:attempt]] with "
                f"action one of {', '.join(_ACTIONS)}"
            )
        if len(parts) > 3 and parts[3] != "" and int(parts[3]) != rank:
            continue
        if int(parts[4] if len(parts) > 4 else 0) != attempt:
            continue
        armed[parts[0]] = (int(parts[1]), parts[2])
    _armed.clear()
    _armed.update(armed)
    _hits.clear()


def point(name: str) -> None:
    """A fault point: does nothing unless ENGRAM_FAULTS armed `name` for this process."""
    if name not in _armed:
        return
    with _lock:
        _hits[name] = hit = _hits.get(name, 0) + 1
    n, action = _armed[name]
    if hit != n or action == "count":
        return
    if action == "kill":
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    code = errno.ENOSPC if action == "enospc" else errno.EIO
    raise OSError(code, f"{os.strerror(code)} (injected by ENGRAM_FAULTS: hit {n} of {name})")


def armed(name: str) -> bool:
    """Whether `name` is armed for this process (a batch then passes its point once per item)."""
    return name in _armed


def hits(name: str) -> int:
    """How many times this process passed the armed point `name` (0 when it is not armed)."""
    with _lock:
        return _hits.get(name, 0)


configure()
