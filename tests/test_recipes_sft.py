"""The fine-tuning run end to end, as the README runs it: `CONFIG_FILE=train_configs/debug_sft.toml
./run_train.sh` (shortened, at 2 ranks) trains LoRA + Engram on synthetic fact QA, evaluates the
exact match of greedy answers (the two ranks decode their shares in step) and exports the merged
model; scripts/eval_qa.py then answers the same questions with the run's checkpoint and with the
export loaded by transformers (apply_chat_template + generate): the same prompt and answer tokens.

transformers runs only in a forked child (see tests/test_hf_transformers.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from launcher import free_port, run_isolated

ROOT = Path(__file__).resolve().parents[1]
N, NEW, STEPS = 12, 8, 6  # questions, new tokens per answer, training steps

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed: pip install -e '.[dev]' for the export tests",
)


def _eval_qa(argv: list[str]) -> dict:
    """scripts/eval_qa.py's main -> its score and every answer's tokens."""
    spec = importlib.util.spec_from_file_location("eval_qa", ROOT / "scripts" / "eval_qa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(argv)
    return {
        "score": result.score, "total": result.total, "skipped": result.skipped,
        "tokens": [(a.where, a.prompt_ids, a.answer_ids, a.text) for a in result.answers],
    }  # fmt: skip


@pytest.mark.slow
def test_debug_sft_trains_evaluates_exact_match_and_exports(tmp_path):
    export = tmp_path / "hf"
    overrides = [
        f"--job.dump_folder={tmp_path / 'runs'}", f"--training.steps={STEPS}",
        f"--checkpoint.interval={STEPS}", "--training.local_batch_size=4",
        "--data.synthetic_num_entities=32", "--data.eval_batches=2",
        f"--data.eval_exact_match={N}", f"--data.eval_max_new_tokens={NEW}",
    ]  # fmt: skip
    env = {
        **os.environ,
        "CONFIG_FILE": "train_configs/debug_sft.toml",
        "NGPU": "2",
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.run(
        ["./run_train.sh", *overrides, f"--export.folder={export}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "debug_sft"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (em,) = [r for r in records if "eval_exact_match" in r]
    assert em["step"] == STEPS and em["eval_questions"] == N
    assert [r["step"] for r in records if "eval_loss" in r] == [STEPS]
    # The export keeps the training chat template (transformers renders it) and loads alone.
    shipped = json.loads((ROOT / "engram/data/assets/tokenizer_config.json").read_text())
    exported = json.loads((export / "tokenizer_config.json").read_text())
    assert exported["chat_template"] == shipped["chat_template"]
    assert {"model.safetensors", "modeling_engram.py", "checksums.sha256"} <= {
        p.name for p in export.iterdir()
    }

    argv = [
        "--job.config_file=train_configs/debug_sft.toml", *overrides,
        "--limit", str(N), "--max_new_tokens", str(NEW),
    ]  # fmt: skip
    # The loop's evaluation (2 FSDP ranks, adapters unmerged) = one process on the checkpoint.
    unmerged = _eval_qa([*argv, "--no_merge"])
    assert (unmerged["total"], unmerged["skipped"]) == (N, 0)
    assert unmerged["score"] == em["eval_exact_match"]
    # Our greedy answers with the adapters merged (the export's weights) = transformers' answers
    # through apply_chat_template(add_generation_prompt=True) + generate, token for token.
    ours = _eval_qa(argv)
    theirs = run_isolated(_eval_qa, [*argv, "--export", str(export)], timeout=900)
    assert theirs["tokens"] == ours["tokens"] and theirs["score"] == ours["score"]
