"""Exact match of greedy answers to a run's held-out questions, on the run's own checkpoint or on
its export loaded by transformers.

    PYTHONPATH=. python scripts/eval_qa.py --job.config_file train_configs/debug_sft.toml \
        [--split val|train] [--limit N] [--max_new_tokens 32] [--answers answers.jsonl] \
        [--export FOLDER] [--source auto|checkpoint|hf|init] [--checkpoint_step N] [--no_merge] \
        [--section.key=value ...]

The questions are the run's chat data (data.dataset = synthetic_chat or chat), `--split val`
(held out: the default) or `train`; engram/inference/qa.py says which conversations are asked,
how (the chat template's generation prompt, greedy, stopping at eos or the end-of-turn token) and
how answers are normalised (case-folded, punctuation removed, whitespace collapsed) before the
comparison. A question whose prompt + max_new_tokens exceeds training.seq_len is skipped and
counted (the model never trained past it), the same ones on both paths.

Our model (default): built and loaded as recipes/generate.py does (engram/inference/: the run's
newest checkpoint or --checkpoint_step, verified against its manifest and fingerprint, DCP
resharded; a DeepSpeed step too; --source hf / init for the others). A LoRA run's adapters are
folded into the base weights first (as the export with export.lora = "merged" holds them, so both
paths run the same weights); --no_merge keeps them apart (what the training loop's
eval_exact_match runs).

`--export FOLDER`: the folder of scripts/export_hf.py (or of the run's export.folder) through
transformers (needs the dev extra): AutoTokenizer's apply_chat_template(messages,
add_generation_prompt=True) and AutoModelForCausalLM.generate (greedy, the folder's
generation_config: it stops at the same tokens), trust_remote_code for the Engram model. Both
paths give the same prompt and answer tokens (tests/test_recipes_sft.py).

Prints the exact match; `--answers` writes one JSON line per question (where, prompt and answer
token ids, the answer, the reference, correct).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.checkpoint.deepspeed_folder import read_deepspeed_step  # noqa: E402
from engram.checkpoint.fingerprint import config_fingerprint  # noqa: E402
from engram.config import JobConfig, load_config  # noqa: E402
from engram.data.tokenizer import load_tokenizer  # noqa: E402
from engram.inference import SOURCES, build_for_generation, load_weights  # noqa: E402
from engram.inference.qa import (  # noqa: E402
    Answer,
    Asker,
    ExactMatch,
    Question,
    exact_match,
    questions,
)
from engram.models.lora import merge_lora_  # noqa: E402
from engram.runtime import device as dev  # noqa: E402
from engram.runtime.logs import init_logging  # noqa: E402


def ours(cfg: JobConfig, args: argparse.Namespace, asker: Asker, items: list[Question]):
    """Greedy answers of the run's model (engram/inference/)."""
    device_type = dev.resolve_device_type(cfg.job.device)
    dev.import_device_backend(device_type)
    device = dev.local_device(device_type, 0)
    model, tokenizer, hasher = build_for_generation(
        cfg, cfg.training.seq_len, device, asker.tokenizer
    )
    fingerprint = config_fingerprint(cfg, tokenizer, hasher)
    source = load_weights(
        model, cfg, args.source, args.checkpoint_step, fingerprint, read_deepspeed_step
    )
    if not args.no_merge:
        merge_lora_(model)
    model.eval()
    return exact_match(model, hasher, asker, items, args.max_new_tokens), source


@torch.no_grad()
def transformers_answers(
    folder: str, cfg: JobConfig, asker: Asker, items: list[Question], max_new_tokens: int
) -> ExactMatch:
    """Greedy answers of the exported folder, loaded and run by transformers alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype="float32")
    model.eval()
    stops = model.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops])
    result = ExactMatch()
    for q in items:
        if q.messages is None:
            ids = tok(q.prompt)["input_ids"]  # the export's post-processor puts eos first
        else:
            kwargs = {**cfg.data.chat_kwargs(), **(q.kwargs or {})}
            enc = tok.apply_chat_template(
                q.messages, tools=q.tools, add_generation_prompt=True, tokenize=True, **kwargs
            )
            ids = enc["input_ids"] if not isinstance(enc, list) else enc
        ids = list(ids)
        if len(ids) + max_new_tokens > cfg.training.seq_len:
            result.skipped += 1
            continue
        prompt = torch.tensor([ids])
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
            do_sample=False,
        )  # fmt: skip
        new = out[0, len(ids) :].tolist()
        answer = new[: next((k for k, t in enumerate(new) if t in stops), len(new))]
        text = tok.decode(answer, skip_special_tokens=True)
        result.answers.append(Answer(q.where, ids, answer, text, q.reference))
    result.total = len(result.answers)
    result.correct = sum(a.correct for a in result.answers)
    return result


def main(argv: list[str] | None = None) -> ExactMatch:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--split", choices=("val", "train"), default="val")
    parser.add_argument("--limit", type=int, default=0, help="the first N questions (0: all)")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--answers", default="", help="write one JSON line per question here")
    parser.add_argument("--export", default="", help="answer with this exported folder instead")
    parser.add_argument("--source", choices=SOURCES, default="auto")
    parser.add_argument("--checkpoint_step", type=int, default=-1)
    parser.add_argument("--no_merge", action="store_true", help="keep LoRA adapters unmerged")
    args, rest = parser.parse_known_args(argv)
    if args.limit < 0 or args.max_new_tokens < 1:
        parser.error("--limit must be >= 0 and --max_new_tokens >= 1")
    cfg = load_config(rest)
    init_logging(0)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    asker = Asker(cfg, tokenizer)
    items = questions(cfg, tokenizer, args.split, args.limit)
    if args.export:
        result = transformers_answers(args.export, cfg, asker, items, args.max_new_tokens)
        source = f"transformers, {args.export}"
    else:
        result, source = ours(cfg, args, asker, items)
    print(
        f"exact match {result.score:.4f} ({result.correct} / {result.total} {args.split} "
        f"questions, {result.skipped} skipped: prompt + {args.max_new_tokens} new tokens > "
        f"training.seq_len {cfg.training.seq_len}); weights: {source}"
    )
    if args.answers:
        with open(args.answers, "w") as f:
            for a in result.answers:
                row = {**vars(a), "correct": a.correct}
                f.write(json.dumps(row) + "\n")
    return result


if __name__ == "__main__":
    main()
