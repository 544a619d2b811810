"""Write two small lm-evaluation-harness tasks over local files (no dataset download needed).

    PYTHONPATH=. python scripts/make_lm_eval_tasks.py --out eval_tasks/ [--docs 64]
    lm-eval run --model hf --model_args pretrained=EXPORTED,trust_remote_code=True,dtype=float32 \
        --include_path eval_tasks/ --tasks engram_facts_ppl engram_facts_capital \
        --device cpu --batch_size 4

The documents are the held-out ("val") split of the synthetic facts data set that
train_configs/debug_model.toml trains on (engram/data/synthetic.py), so a debug run scores on
facts it was trained to know:

  engram_facts_ppl      loglikelihood_rolling of every document (word / byte perplexity,
                        bits per byte), like lm-eval's wikitext task.
  engram_facts_capital  generate_until: each document cut before the name of a capital
                        ("... The capital of X is"), greedy continuation until "."; exact match.

For a real model use lm-eval's own tasks (they download their data sets from the Hugging Face
Hub) with the same --model hf --model_args; docs/export.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engram.data.synthetic import SyntheticFacts  # noqa: E402

_CAPITAL = re.compile(r"The capital of (\w+) is (\w+)\.")

_PPL = """task: engram_facts_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""

_CAPITAL_TASK = """task: engram_facts_capital
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  do_sample: false
  max_gen_toks: 16
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "^\\\\s*(\\\\w+)"
        group_select: 0
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the task YAMLs and their data")
    p.add_argument("--docs", type=int, default=64, help="documents per task")
    p.add_argument("--seed", type=int, default=1234, help="data.synthetic_seed of the run")
    p.add_argument("--entities", type=int, default=512, help="data.synthetic_num_entities")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    facts = SyntheticFacts(a.seed, a.entities, 0, "val")
    docs, cloze = [], []
    i = 0
    while len(docs) < a.docs or len(cloze) < a.docs:
        text = facts[i]
        i += 1
        if len(docs) < a.docs:
            docs.append({"text": text})
        m = _CAPITAL.search(text)
        if m and len(cloze) < a.docs:
            prompt = text[: m.start()] + f"The capital of {m.group(1)} is"
            cloze.append({"prompt": prompt, "answer": m.group(2)})
    files = [out / "facts_docs.jsonl", out / "facts_capital.jsonl"]
    for file, rows in zip(files, (docs, cloze), strict=True):
        file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "engram_facts_ppl.yaml").write_text(_PPL.format(data=files[0]))
    (out / "engram_facts_capital.yaml").write_text(_CAPITAL_TASK.format(data=files[1]))
    written = [*files, out / "engram_facts_ppl.yaml", out / "engram_facts_capital.yaml"]
    for f in written:
        print(f"wrote {f}")
    return written


if __name__ == "__main__":
    main()
