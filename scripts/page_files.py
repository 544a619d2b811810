"""List or remove the NVMe table page files that dead runs left in the given directories.

    python scripts/page_files.py list DIR [DIR ...]      # what a killed run left, and where
    python scripts/page_files.py remove DIR [DIR ...]    # remove exactly those

A run removes its page files (`<table>.pid<pid>.rank<rank>.pages`, a whole table shard per rank)
when it exits; a run killed with kill -9, or a node that crashed, leaves them. The next run that
uses the same engram.nvme_dirs removes them at start; this command does it by hand, e.g. before
giving the drives to another job. A file counts as dead when no process holds its lock: every
live store locks its files for as long as it has them open, so a running job's files are never
listed or removed (engram/rowstore/page_files.py; each directory is examined under the same
directory lock the stores take). Run it on the machine whose drives they are (the locks are
local).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.rowstore.page_files import dead_page_files, remove_dead_page_files  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=("list", "remove"))
    p.add_argument("dirs", nargs="+", help="engram.nvme_dirs directories")
    args = p.parse_args(argv)
    find = dead_page_files if args.action == "list" else remove_dead_page_files
    total_files = total_bytes = 0
    for d in args.dirs:
        try:
            files = find(d)
        except FileNotFoundError as e:
            print(f"{d}: {e.strerror}", file=sys.stderr)
            return 2
        for f in files:
            print(f"{f.path}\t{f.bytes / 2**30:.3f} GiB\t{f.describe()}")
        total_files += len(files)
        total_bytes += sum(f.bytes for f in files)
    done = "dead page files" if args.action == "list" else "dead page files removed"
    print(f"{total_files} {done}, {total_bytes / 2**30:.3f} GiB (live runs' files left alone)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
