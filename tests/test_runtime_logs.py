"""engram/runtime/logs.py: every logger of the repository prints with rank, time and level.

The buffered-I/O fallback of the NVMe tables and the float8-without-compile warning used to go
through loggers nobody configured (parallelisms.*): a bare message, no level, rank or time."""

from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from engram.runtime.logs import LOGGERS, init_logging

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^\[rank(\d)\] \d\d:\d\d:\d\d (INFO|WARNING) (.*)$")


def test_each_rank_logs_its_level():
    log = init_logging(1)
    assert not log.isEnabledFor(logging.INFO) and log.isEnabledFor(logging.WARNING)
    log = init_logging(0)
    assert log.isEnabledFor(logging.INFO)
    for name in LOGGERS:  # idempotent: one handler each
        handlers = logging.getLogger(name).handlers
        assert sum(type(h).__name__ == "ConsoleHandler" for h in handlers) == 1, name


def test_unconfigured_children_print_with_rank_time_and_level():
    """A fresh process, as at start: the page files' and float8's loggers (children of
    "parallelisms") and a runner / planner one print like the recipe's own lines."""
    code = (
        "import logging\n"
        "from engram.runtime.logs import init_logging\n"
        "init_logging(0)\n"
        "logging.getLogger('parallelisms.engram_tables.nvme_store').warning('buffered I/O')\n"
        "logging.getLogger('parallelisms.float8').warning('float8 without compile')\n"
        "logging.getLogger('runner.step').info('runner line')\n"
        "logging.getLogger('planner.estimate').info('planner line')\n"
        "logging.getLogger('engram').info('engram line')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    lines = out.stdout.strip().splitlines()
    assert out.stderr == "", out.stderr  # nothing through Python's last-resort handler
    got = [LINE.match(line) for line in lines]
    assert all(got), lines
    assert [m.group(2, 3) for m in got] == [
        ("WARNING", "buffered I/O"), ("WARNING", "float8 without compile"),
        ("INFO", "runner line"), ("INFO", "planner line"), ("INFO", "engram line"),
    ]  # fmt: skip


def test_every_logger_in_the_source_is_configured():
    """Every logging.getLogger(...) of the source names a logger under LOGGERS (a literal, or
    __name__ of a module in one of those packages)."""
    bad = []
    for top in LOGGERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "engram/runtime/logs.py":  # configures them, by LOGGERS
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not (
                    isinstance(node, ast.Call) and ast.unparse(node.func).endswith("getLogger")
                ):
                    continue
                arg = node.args[0] if node.args else None
                name = arg.value if isinstance(arg, ast.Constant) else None
                if isinstance(arg, ast.Name) and arg.id == "__name__":
                    continue  # the module's own dotted name, under `top`
                if name is None or name.split(".")[0] not in LOGGERS:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "loggers init_logging does not configure:\n" + "\n".join(bad)
