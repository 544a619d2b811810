"""Tokenizer, document sources, sequence packing, prepared token shards, fine-tuning data (chat
records, chat templates, target masks, conversation rows, prepared chat shards) and the loader.

Names are imported lazily so that scripts/prepare_data.py (tokenizer + numpy only) does not pay
for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Collate": "engram.data.loader",
    "DataLoader": "engram.data.loader",
    "PackedDataset": "engram.data.loader",
    "build_dataloader": "engram.data.loader",
    "build_dataset": "engram.data.loader",
    "build_documents": "engram.data.datasets",
    "Tokenizer": "engram.data.tokenizer",
    "load_tokenizer": "engram.data.tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engram.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
