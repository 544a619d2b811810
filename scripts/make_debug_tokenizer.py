"""Train the small byte-level BPE tokenizer shipped as engram/data/assets/debug_tokenizer.json,
and write its tokenizer_config.json (special tokens + a small chat template) beside it.

    python scripts/make_debug_tokenizer.py [--out engram/data/assets/debug_tokenizer.json]

Training text: synthetic fact documents (the default dataset) plus generic English written in
several casings, with accents and irregular whitespace, so that Engram's tokenizer compression
(NFKC + lower-case + accent stripping + whitespace collapsing) has distinct tokens to merge.
Deterministic: same text and trainer settings give the same merges (checked by
tests/test_data.py; also seen with TOKENIZERS_PARALLELISM=true). The chat template is
ChatML-like on the existing special tokens (<|bos|>role\n ... <|eos|>\n), so adding it changed no
id: fine-tuning the debug model needs no new embedding rows.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engram.data.synthetic import SyntheticFacts

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
OUT = Path(__file__).resolve().parent.parent / "engram" / "data" / "assets" / "debug_tokenizer.json"

CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|bos|>' + message['role'] + '\\n' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- elif message['content'] is defined %}\n"
    "{{- message['content'] | tojson }}\n"
    "{%- endif %}\n"
    "{%- if message['tool_calls'] is defined %}\n"
    "{{- message['tool_calls'] | tojson }}\n"
    "{%- endif %}\n"
    "{{- '<|eos|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|bos|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def tokenizer_config() -> dict:
    """tokenizer_config.json of the debug tokenizer, as a Hugging Face folder holds it."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "chat_template": CHAT_TEMPLATE,
    }


ENGLISH = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Memory is the treasury and guardian of all things. Knowledge is of two kinds: we know a subject
ourselves, or we know where we can find information upon it. The river flows to the sea, and the
sea returns as rain upon the hills. Every city has a story, and every story has a beginning.
In the morning the market opens early; merchants bring bread, cheese, fruit and fresh fish.
The library keeps old maps of forgotten kingdoms, written by travellers who crossed the mountains.
Scientists measure the weight of atoms, the speed of light and the age of distant stars.
She said: "Learning never exhausts the mind." He answered, 'Then let us learn something new today!'
Numbers like 1, 2, 3, 10, 42, 100, 2024 and 3.14 appear in text all the time.
The café on the corner serves crème brûlée; the naïve tourist ordered a jalapeño smoothie.
Zürich, São Paulo, Kraków, Málaga and Reykjavík are cities with accented names.
Her résumé mentions a façade restoration and a fiancée who studied the Ångström unit.
"""

ACCENTED = "café Café CAFÉ cafe naïve naive résumé resume Zürich Zurich São Sao façade facade"


def _variants(line: str, rng: random.Random) -> list[str]:
    """The same words in several casings and spacings (what compression should merge)."""
    words = line.split()
    spaced = "".join(w + rng.choice([" ", "  ", "\t", " \n", "   "]) for w in words)
    return [line, line.upper(), line.lower(), line.title(), spaced, "  " + line.lower() + "\n"]


def training_text(num_fact_docs: int = 3000) -> list[str]:
    facts = SyntheticFacts(fact_seed=1234, num_entities=512, stream_seed=0, split="train")
    texts = [facts[i] for i in range(num_fact_docs)]
    rng = random.Random("engram-debug-tokenizer")
    for line in ENGLISH.splitlines() + [ACCENTED]:
        texts.extend(_variants(line, rng))
    # Upper-cased / lower-cased fact sentences too, so " capital" and " Capital" both exist.
    texts.extend(facts[i].upper() for i in range(200))
    texts.extend(facts[i].lower() for i in range(200))
    return texts


def build_debug_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    tok = build_debug_tokenizer()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out), pretty=False)
    config = args.out.parent / "tokenizer_config.json"
    config.write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, vocab {tok.get_vocab_size()})")
    print(f"wrote {config}")


if __name__ == "__main__":
    main()
