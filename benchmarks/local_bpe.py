"""A Qwen2.5-shaped byte-level BPE tokenizer trained on local text (nothing downloaded), for
measuring Engram table row reuse at the 32B configs' vocabulary size (bench_table_reuse.py
--tokenizer). Not a tokenizer to train with: only its size and shape match Qwen2.5's.

    python benchmarks/local_bpe.py --corpus FILES... --out outputs/tokenizers/local_bpe151k

205 MiB of local text reach the full 151,665 tokens in about a minute (docs/host_tables.md,
"Row reuse on real text", has the corpus and how to rebuild it); 24 MB ran out at 77k.

Shape (as Qwen2.5's tokenizer.json): NFC normalization, Qwen2's pre-tokenizer regex split then
byte-level bytes, a BPE of `vocab` - 22 tokens (151,643 for Qwen2.5's 151,665), then Qwen2.5's
22 special tokens after it (<|endoftext|> = 151,643 ...). The trainer (HF `tokenizers`) stops
early when the corpus has no more pairs to merge: the report says the size reached.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN25_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
QWEN25_VOCAB = 151_665


def train(files: list[str], vocab: int = QWEN25_VOCAB) -> Tokenizer:
    """The tokenizer (see the module docstring) trained on `files` (plain text)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(QWEN25_SPECIALS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    tok.add_special_tokens(QWEN25_SPECIALS)
    return tok


def trained(files: list[str], out: Path, vocab: int = QWEN25_VOCAB) -> Path:
    """out/tokenizer.json, trained on `files` unless it is there already (same files, vocab:
    recorded beside it)."""
    key = "\n".join([str(vocab), *sorted(str(Path(f).resolve()) for f in files)])
    path, stamp = out / "tokenizer.json", out / "trained_on.txt"
    if path.is_file() and stamp.is_file() and stamp.read_text() == key:
        return path
    out.mkdir(parents=True, exist_ok=True)
    tok = train(files, vocab)
    tok.save(str(path))
    stamp.write_text(key)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", nargs="+", required=True, help="plain-text files")
    ap.add_argument("--out", required=True, help="folder for tokenizer.json")
    ap.add_argument("--vocab", type=int, default=QWEN25_VOCAB)
    args = ap.parse_args()
    path = trained(args.corpus, Path(args.out), args.vocab)
    size = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    mib = sum(Path(f).stat().st_size for f in args.corpus) / 2**20
    print(f"{path}: {size:,} tokens (asked {args.vocab:,}) from {mib:.1f} MiB of text")
    if size < args.vocab:
        sys.exit(f"the corpus ran out of merges at {size:,} tokens: add text")


if __name__ == "__main__":
    main()
