"""Thin wrapper over a HF `tokenizers` tokenizer.json: ids of the special tokens we need.

`encode` never adds special tokens (the packer inserts eos between documents itself), and
`.hf` exposes the raw `tokenizers.Tokenizer` that Engram's compression table is built from.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

DEBUG_TOKENIZER = Path(__file__).resolve().parent / "assets" / "debug_tokenizer.json"

# First match wins. Llama 3, GPT-2/Qwen, Llama 2/Mistral, Gemma, DeepSeek, and our debug names.
EOS_TOKENS = (
    "<|eos|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "</s>",
    "<eos>",
    "<｜end▁of▁sentence｜>",
)
BOS_TOKENS = ("<|bos|>", "<|begin_of_text|>", "<s>", "<bos>", "<｜begin▁of▁sentence｜>")
PAD_TOKENS = ("<|pad|>", "<pad>", "<|finetune_right_pad_id|>", "<｜▁pad▁｜>", "[PAD]")


class Tokenizer:
    def __init__(self, hf: HFTokenizer, source: str = "") -> None:
        self.hf = hf
        self.source = source
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        eos = self._find(EOS_TOKENS)
        if eos is None:
            raise ValueError(
                f"tokenizer {source or '<in-memory>'} has none of the end-of-document tokens "
                f"{', '.join(EOS_TOKENS)}; add one as a special token to its tokenizer.json"
            )
        self.eos_id: int = eos
        self.bos_id: int | None = self._find(BOS_TOKENS)
        pad = self._find(PAD_TOKENS)
        # No pad token (Llama 3, Qwen): pad with eos, the usual convention.
        self.pad_id: int = eos if pad is None else pad

    def _find(self, candidates: tuple[str, ...]) -> int | None:
        for token in candidates:
            token_id = self.hf.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hash of the canonical tokenizer JSON (prepared token shards record it)."""
        canon = json.dumps(json.loads(self.hf.to_str()), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
            f"eos={self.eos_id}, pad={self.pad_id})"
        )


def load_tokenizer(path: str | Path = "") -> Tokenizer:
    """A tokenizer.json (or a folder holding one); empty path: the shipped debug tokenizer."""
    file = Path(path) if str(path) else DEBUG_TOKENIZER
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"tokenizer file {file} does not exist: set model.tokenizer_path to a HF tokenizer.json "
            "(or its folder), or leave it empty for the debug tokenizer"
        )
    return Tokenizer(HFTokenizer.from_file(str(file)), str(file))
