"""The training step is held in one place: runner/step.py TrainStep (and its DeepSpeed parts,
runner/engine_step.py EngineStep). Everything that trains or times a step (the recipes, the trial
step behind check_cluster's real_step and bench_mfu) calls it; none of them calls the step's
pieces (the CP cut, forward / backward, the PP schedule, host-table prefetch, clipping, the
update) itself, so a copy of the step cannot drift from it again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIECES = {
    "split_batch", "forward_backward", "pipeline_forward_backward", "prefetch_host_tables",
    "clip_grad_norm_", "clip_engine_and_tables_", "step_optimizers", "dp_mean",
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


def _trial_pages(rank: int, world: int, folder: str) -> list[tuple[int, int, int]]:
    """run_trial_step of the debug config's cut with NVMe tables; (pins, page-ins of a later
    step's rows) of each store."""
    import torch

    from engram.config import load_config
    from engram.rowstore.nvme_store import NvmeRowStore
    from parallelisms.engram_tables import NvmeShardedEngramTable
    from parallelisms.parallel_dims import parallel_dims_from_config
    from runner import trial_step

    argv = [f"--job.config_file={ROOT / 'train_configs/debug_model.toml'}", "--job.device=cpu",
            f"--job.dump_folder={folder}", "--engram.table_location=nvme",
            f"--engram.nvme_dirs={folder}/pages", "--engram.nvme_host_cache_gib=0.002",
            "--optimizer.table_optimizer=lazy_adam"]  # fmt: skip
    cfg = load_config(argv)
    dims = parallel_dims_from_config(cfg, world)
    cut, _ = trial_step.cut_config(cfg, 2, True)
    dims.build_mesh("cpu")
    build, parts = trial_step.build_model_parts, []

    def kept(*args):
        out = build(*args)
        parts.extend(out[0])
        return out

    page_in, page_ins = NvmeRowStore.page_in_now, {}

    def counted(self, idx):
        page_ins[id(self)] = page_ins.get(id(self), 0) + 1
        return page_in(self, idx)

    trial_step.build_model_parts = kept
    NvmeRowStore.page_in_now = counted
    trial_step.run_trial_step(cut, dims, torch.device("cpu"), steps=3)
    stores = [m._engram_store for p in parts for m in p.modules()
              if isinstance(m, NvmeShardedEngramTable)]  # fmt: skip
    return [(s.pins_taken, page_ins.get(id(s), 0)) for s in stores]


@pytest.mark.slow
def test_trial_step_pages_in_the_next_step_as_the_loop_does(tmp_path: Path) -> None:
    """The trial step (check_cluster's real_step, bench_mfu) reads its batches one step ahead
    with the loop's ReadAhead: with NVMe tables, steps 2 and 3 are paged in while the step
    before runs (before, the tools timed NVMe configs without the page-in training has)."""
    from launcher import run_distributed

    (stores,) = run_distributed(_trial_pages, 1, str(tmp_path))
    assert stores, "the cut has an NVMe table"
    for pins, page_ins in stores:
        assert pins == 3 and page_ins == 2, (pins, page_ins)
