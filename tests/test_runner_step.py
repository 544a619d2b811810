"""The training step is held in one place: runner/step.py TrainStep (and its DeepSpeed parts,
runner/engine_step.py EngineStep). Everything that trains or times a step (the recipes, the trial
step behind check_cluster's real_step and bench_mfu) calls it; none of them calls the step's
pieces (the CP cut, forward / backward, the PP schedule, host-table prefetch, clipping, the
update) itself, so a copy of the step cannot drift from it again.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIECES = {
    "split_batch", "forward_backward", "pipeline_forward_backward", "prefetch_host_tables",
    "clip_grad_norm_", "clip_engine_and_tables_", "step_optimizers", "ranks_sum",
}  # fmt: skip
THE_STEP = {"runner/step.py", "runner/engine_step.py"}
# Benchmarks that time one piece in isolation, not a training step: the CP cut and attention
# (bench_cp), and a hand-written step mirroring engram-peft's for a like-for-like comparison
# (bench_table_step).
PIECE_BENCHMARKS = {"benchmarks/bench_cp.py", "benchmarks/bench_table_step.py"}


def _calls(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if name in PIECES:
                found.append((node.lineno, name))
    return found


def test_only_the_step_calls_the_step_pieces() -> None:
    files = [
        p
        for top in ("recipes", "scripts", "benchmarks", "runner")
        for p in sorted((ROOT / top).rglob("*.py"))
    ]
    bad = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in THE_STEP | PIECE_BENCHMARKS:
            continue
        bad += [f"{rel}:{line}: calls {name}" for line, name in _calls(path)]
    assert not bad, "use runner/step.py TrainStep:\n" + "\n".join(bad)
    assert {name for _, name in _calls(ROOT / "runner/step.py")} >= PIECES - {
        "clip_engine_and_tables_"
    }


def test_every_caller_runs_the_step() -> None:
    for rel in ("recipes/train.py", "runner/trial_step.py"):
        assert "TrainStep(" in (ROOT / rel).read_text(), rel
    assert "EngineStep(" in (ROOT / "recipes/train_deepspeed.py").read_text()
    assert "run_trial_step" in (ROOT / "benchmarks/bench_mfu.py").read_text()
    assert "run_trial_step" in (ROOT / "scripts/cluster_step.py").read_text()
