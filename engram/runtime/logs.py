"""The process's log lines: every logger of this repository prints with its rank, time and level.

`init_logging(rank)` runs once at process start (engram/train/build.py init_process, the other
entry points after their process group): one console handler on each top-level logger of the
repository (LOGGERS: "engram", "parallelisms", "runner", ...), so a child logger
(`logging.getLogger(__name__)` in parallelisms/float8.py, the page files' I/O fallback) prints
"[rank0] 12:00:00 WARNING ..." like the recipe's own lines instead of a bare message through
Python's last-resort handler. Rank 0 shows INFO, the other ranks WARNING and above.
"""

from __future__ import annotations

import logging
import sys

# The top-level packages of the repository whose modules log (tests/test_runtime_logs.py checks
# that every logger named in the source sits under one of them).
LOGGERS = ("engram", "parallelisms", "runner", "planner", "recipes", "scripts", "benchmarks")
FORMAT = "[rank{rank}] %(asctime)s %(levelname)s %(message)s"


class ConsoleHandler(logging.StreamHandler):
    """The handler init_logging installs (its own class, so a second call replaces it)."""


def init_logging(rank: int, level: int = logging.INFO) -> logging.Logger:
    """Configure every logger of LOGGERS for this rank; returns the "engram" logger.
    Idempotent: calling it again replaces the handlers instead of adding second ones."""
    formatter = logging.Formatter(FORMAT.format(rank=rank), "%H:%M:%S")
    for name in LOGGERS:
        log = logging.getLogger(name)
        for h in list(log.handlers):
            if isinstance(h, ConsoleHandler):
                log.removeHandler(h)
        handler = ConsoleHandler(sys.stdout)
        handler.setFormatter(formatter)
        log.addHandler(handler)
        log.setLevel(level if rank == 0 else max(level, logging.WARNING))
        log.propagate = False  # one line per message even when the root logger has handlers
    return logging.getLogger("engram")
