"""Builds the optional C hashing kernel (engram/hashing/csrc/ngram_hash.c); everything else is in
pyproject.toml. Without a C compiler the build is skipped and engram/hashing/ngram.py uses its
numpy/torch kernel (same ids, ~1.5x slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "engram.hashing._ngram_hash",
            sources=["engram/hashing/csrc/ngram_hash.c"],
            extra_compile_args=["-O3", "-fno-trapping-math"],
            optional=True,
        )
    ]
)
