"""Tokenise a corpus into memory-mapped token shards for `data.dataset = "tokens"`.

    python scripts/prepare_data.py --input corpus/ --out data/my_corpus \
        --tokenizer path/to/tokenizer.json --workers 16

Inputs: .jsonl files (one JSON object a line, text in --text-field) and .txt files (documents
separated by blank lines), or folders of them. Use the tokenizer of the run
(model.tokenizer_path; --config takes it from a training TOML). Interrupted? Rerun the same
command: finished shards are kept. Format and guarantees: engram/data/prepare.py, shards.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.data.prepare import Options, prepare  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl / .txt files or folders")
    p.add_argument("--out", required=True, help="output folder (data.path of the run)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the debug one)")
    p.add_argument("--config", default=None, help="take the tokenizer from this training TOML")
    p.add_argument("--text-field", default="text", help="jsonl field holding the text")
    p.add_argument("--workers", type=int, default=1, help="tokeniser processes")
    p.add_argument("--shard-mb", type=float, default=256, help="input MB per shard")
    p.add_argument("--no-eos", action="store_true", help="do not append eos after documents")
    p.add_argument("--bos", action="store_true", help="prepend bos (if the tokenizer has one)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    args = p.parse_args(argv)
    tokenizer = args.tokenizer
    if args.config:
        if tokenizer is not None:
            p.error("pass --tokenizer or --config, not both")
        from engram.config import load_config

        tokenizer = load_config([f"--job.config_file={args.config}"]).model.tokenizer_path
    if args.workers < 1 or args.shard_mb <= 0:
        p.error("--workers must be >= 1 and --shard-mb > 0")
    opts = Options(
        tokenizer_path=tokenizer or "",
        text_field=args.text_field,
        append_eos=not args.no_eos,
        prepend_bos=args.bos,
        shard_bytes=max(1, int(args.shard_mb * (1 << 20))),
        workers=args.workers,
    )
    m = prepare(args.input, args.out, opts, progress=not args.quiet)
    print(
        f"{args.out}: {m['num_tokens']:,} tokens, {m['num_docs']:,} documents, "
        f'{len(m["shards"])} shards ({m["dtype"]}); train with data.dataset = "tokens", '
        f'data.path = "{args.out}"'
    )


if __name__ == "__main__":
    main()
