"""Cost of the checkpoint manifest's checksum (CRC-32, engram.checkpoint.file_checksum) per GB,
next to the alternatives that were considered, on a file in the page cache (the cost a save or
load adds on top of the disk reads/writes DCP already does).

    PYTHONPATH=. python benchmarks/bench_checksum.py [--mib 512]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
import zlib
from pathlib import Path

from engram.checkpoint import file_checksum

CHUNK = 8 << 20


def _hashlib(name: str):
    def run(path: Path) -> None:
        h = hashlib.new(name)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)

    return run


def _adler(path: Path) -> None:
    a = 1
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            a = zlib.adler32(chunk, a)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.bin"
        with open(path, "wb") as f:
            for _ in range(args.mib // 8):
                f.write(os.urandom(CHUNK))
        file_checksum(path)  # warm the page cache
        print(f"{args.mib} MiB file, s per GiB (one core):")
        for name, fn in [
            ("crc32 (used)", file_checksum),
            ("adler32", _adler),
            ("sha256", _hashlib("sha256")),
            ("blake2b", _hashlib("blake2b")),
            ("md5", _hashlib("md5")),
        ]:
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                fn(path)
                best = min(best, time.perf_counter() - t)
            print(f"  {name:14s} {best * 1024 / args.mib:.3f}")


if __name__ == "__main__":
    main()
