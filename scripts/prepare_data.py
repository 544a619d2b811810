"""Tokenise a corpus into memory-mapped token shards for `data.dataset = "tokens"`, or a
fine-tuning set into chat shards for `data.dataset = "chat"` (--chat).

    python scripts/prepare_data.py --input corpus/ --out data/my_corpus \
        --tokenizer path/to/tokenizer.json --workers 16
    python scripts/prepare_data.py --chat --input sft/ --out data/my_sft \
        --config train_configs/my_sft.toml --workers 16

Inputs: .jsonl files (one JSON object a line, text in --text-field) and .txt files (documents
separated by blank lines), or folders of them. With --chat: .jsonl and .parquet files of
`messages`, `prompt` + `completion` or `text` records (engram/data/chat_records.py), rendered
with the tokenizer's chat template (or --chat-template), each conversation's tokens written with
its target mask. Use the tokenizer of the run (model.tokenizer_path; --config takes it, and with
--chat data.chat_template / chat_template_kwargs, from a training TOML). Interrupted? Rerun the
same command: finished shards are kept. Format and guarantees: engram/data/prepare.py,
prepare_sft.py, shards.py.
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
    p.add_argument("--chat", action="store_true", help="fine-tuning records -> chat shards")
    p.add_argument("--chat-template", default=None, help="--chat: .jinja or tokenizer_config.json")
    p.add_argument("--chat-template-kwargs", default=None, help="--chat: JSON object")
    args = p.parse_args(argv)
    tokenizer, template, kwargs = args.tokenizer, args.chat_template, args.chat_template_kwargs
    if args.config:
        if tokenizer is not None:
            p.error("pass --tokenizer or --config, not both")
        from engram.config import load_config

        cfg = load_config([f"--job.config_file={args.config}"])
        tokenizer = cfg.model.tokenizer_path
        template = cfg.data.chat_template if template is None else template
        kwargs = cfg.data.chat_template_kwargs if kwargs is None else kwargs
    if args.workers < 1 or args.shard_mb <= 0:
        p.error("--workers must be >= 1 and --shard-mb > 0")
    if args.chat:
        from engram.data.prepare_sft import ChatOptions, prepare_chat

        chat = ChatOptions(
            tokenizer_path=tokenizer or "",
            chat_template=template or "",
            chat_template_kwargs=kwargs or "",
            shard_bytes=max(1, int(args.shard_mb * (1 << 20))),
            workers=args.workers,
        )
        m = prepare_chat(args.input, args.out, chat, progress=not args.quiet)
        print(
            f"{args.out}: {m['num_conversations']:,} conversations, {m['num_tokens']:,} tokens "
            f"({m['num_targets']:,} targets), {m['skipped']:,} skipped without a target, "
            f'{len(m["shards"])} shards; train with data.dataset = "chat", '
            f'data.path = "{args.out}"'
        )
        return
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
