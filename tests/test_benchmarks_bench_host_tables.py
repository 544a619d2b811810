"""bench_host_tables.py's NVMe side (no run of the benchmark: its parts that decide what it
reports): page files on tmpfs are refused unless asked for, and the ratio is the median of the
per-pair ratios with their min-max."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_host_tables as bench  # noqa: E402


def test_page_files_on_tmpfs_are_refused_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "_filesystem", lambda path: "tmpfs")
    args = argparse.Namespace(nvme_dir=str(tmp_path / "pages"), allow_tmpfs=False)
    with pytest.raises(SystemExit, match="on tmpfs .*--allow_tmpfs"):
        bench._nvme_dir(args)
    args.allow_tmpfs = True
    assert bench._nvme_dir(args) == tmp_path / "pages"
    monkeypatch.undo()
    if Path("/dev/shm").is_dir():  # the real mount table: /dev/shm is tmpfs on Linux
        assert bench._filesystem(Path("/dev/shm")) == "tmpfs"


def test_the_ratio_is_the_median_of_pairs_with_its_range():
    # pair 3 ran while the machine was loaded: both sides slow, its ratio still ~1.1
    mid, lo, hi = bench.pair_ratios([1.0, 1.0, 3.0, 1.0, 1.0], [1.1, 1.2, 3.3, 1.0, 1.5])
    assert (round(mid, 6), lo, round(hi, 6)) == (1.1, 1.0, 1.5)
    with pytest.raises(ValueError, match="as many runs"):
        bench.pair_ratios([1.0], [1.0, 2.0])
