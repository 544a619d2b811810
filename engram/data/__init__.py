"""Tokenizer, document sources, sequence packing and the stateful loader (with Engram hash ids)."""

from engram.data.datasets import build_documents
from engram.data.loader import Collate, PackedDataset, build_dataloader, build_dataset
from engram.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "Collate",
    "PackedDataset",
    "Tokenizer",
    "build_dataloader",
    "build_dataset",
    "build_documents",
    "load_tokenizer",
]
