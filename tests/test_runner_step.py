"""The training step is held in one place: runner/step.py TrainStep (and its DeepSpeed parts,
runner/engine_step.py EngineStep), with the pieces it calls (engram/train/step.py forward /
backward and the optimizers' step, the loss, the optimizers' update rules). Everything that
trains or times a step (the recipes, the trial step behind check_cluster's real_step and
bench_mfu, the compile and overhead benchmarks) calls it, so a copy of the step cannot drift
from it again.

An AST walk over every source file outside tests/ flags what a hand-written step is made of: a
`.backward(` (or torch.autograd.backward / grad), an optimizer's `.step(` (anything's `.step(`
but a profiler's tick), an update written by hand (an in-place op or `+=` / `-=` that reads a
`.grad`), and a call of the step's pieces by name. Files outside the step that must do one of
these (a benchmark timing a piece alone, another library's step) are exempt by name, each with
its reason in one line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("recipes", "engram", "parallelisms", "runner", "planner", "scripts", "benchmarks")
PIECES = {
    "split_batch", "forward_backward", "pipeline_forward_backward", "prefetch_host_tables",
    "clip_grad_norm_", "clip_engine_and_tables_", "step_optimizers", "ranks_sum",
}  # fmt: skip
# The step and the pieces it calls; a piece's own module may use what it is made of.
THE_STEP = {
    "runner/step.py": "TrainStep: the order of one training step",
    "runner/engine_step.py": "EngineStep: the DeepSpeed engine's backward / step",
    "engram/train/step.py": "forward_backward (incl. the PP schedule's step) and step_optimizers",
    "engram/train/loss.py": "the chunked loss computes its head's gradients chunk by chunk",
}
STEP_DIRS = {"engram/optim/": "the optimizers' update rules, called only by step_optimizers"}
# Outside the step, each with why it may (one line each).
EXEMPT = {
    "benchmarks/bench_cp.py": "times the CP cut and attention's forward / backward alone",
    "benchmarks/bench_chunked_loss.py": "times the loss's forward / backward alone",
    "benchmarks/bench_table_a2a.py": "counts the table lookup's all-to-all bytes, fwd and bwd",
    "benchmarks/bench_engram_tables.py": "table lookup bytes and memory vs a DDP-style replica",
    "benchmarks/bench_table_step.py": "mirrors engram-peft's hand-written step like for like",
    "benchmarks/engram_peft_worker.py": "engram-peft's own step, in its own environment",
    "scripts/check_cluster.py": "checks collectives and FSDP2 against hand-made references; "
    "its real_step runs TrainStep through run_trial_step",
}
# The step's pieces by name, searched where they were once copied (not where they are defined).
PIECE_DIRS = ("recipes", "scripts", "benchmarks", "runner")


def _name(node: ast.AST) -> str:
    return ast.unparse(node) if isinstance(node, ast.expr) else ""


def _reads_grad(*nodes: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Attribute) and n.attr == "grad" for node in nodes for n in ast.walk(node)
    )


def step_parts(source: str, pieces: bool = True) -> list[str]:
    """What a hand-written training step is made of in `source`, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)):
            if _reads_grad(node.target, node.value):
                found.append(f"{node.lineno}: update by hand ({ast.unparse(node)})")
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        attr = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        owner = _name(f.value) if isinstance(f, ast.Attribute) else ""
        if attr == "backward" or (attr == "grad" and owner.endswith("autograd")):
            found.append(f"{node.lineno}: {owner}.{attr}(")
        elif attr == "step" and "prof" not in owner.lower():  # a profiler's tick is not an update
            found.append(f"{node.lineno}: {owner}.step(")
        elif attr.endswith("_") and not attr.startswith("_") and _reads_grad(f, *node.args):
            found.append(f"{node.lineno}: update by hand ({ast.unparse(node)})")
        elif pieces and attr in PIECES:
            found.append(f"{node.lineno}: calls the step's piece {attr}")
    return sorted(found, key=lambda hit: int(hit.split(":")[0]))


def _sources() -> list[tuple[str, Path]]:
    return [
        (p.relative_to(ROOT).as_posix(), p)
        for top in SOURCE_DIRS
        for p in sorted((ROOT / top).rglob("*.py"))
    ]


def test_no_step_is_written_outside_the_step() -> None:
    bad = []
    for rel, path in _sources():
        if rel in THE_STEP or rel in EXEMPT or any(rel.startswith(d) for d in STEP_DIRS):
            continue
        pieces = rel.split("/")[0] in PIECE_DIRS
        bad += [f"{rel}:{hit}" for hit in step_parts(path.read_text(), pieces)]
    assert not bad, "train or time a step through runner/step.py TrainStep:\n" + "\n".join(bad)


def test_the_check_fails_on_a_planted_hand_written_step() -> None:
    planted = (
        "def bench(model, opt, batch, lr):\n"
        "    loss = model(batch).mean()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    for p in model.parameters():\n"
        "        p.data.add_(p.grad, alpha=-lr)\n"
        "        p.data -= lr * p.grad\n"
        "    torch.autograd.backward([loss])\n"
        "    prof.step()\n"
    )
    hits = step_parts(planted)
    assert [h.split(":")[0] for h in hits] == ["3", "4", "6", "7", "8"], hits
    assert step_parts("clip_grad_norm_(params, 1.0)\n") and not step_parts(
        "clip_grad_norm_(params, 1.0)\n", pieces=False
    )


def test_exemptions_are_real_and_say_why_in_one_line() -> None:
    for rel, why in {**THE_STEP, **EXEMPT, **STEP_DIRS}.items():
        assert (ROOT / rel).exists(), f"{rel} is exempt but does not exist"
        assert why and "\n" not in why, rel
    for rel in EXEMPT:  # an exemption that no longer needs it is dropped
        assert step_parts((ROOT / rel).read_text()), f"{rel} no longer needs its exemption"
    pieces = {h.split("piece ")[-1] for h in step_parts((ROOT / "runner/step.py").read_text())}
    assert pieces >= PIECES - {"clip_engine_and_tables_"}, pieces


def test_every_caller_runs_the_step() -> None:
    for rel in ("recipes/train.py", "runner/trial_step.py"):
        assert "TrainStep(" in (ROOT / rel).read_text(), rel
    assert "EngineStep(" in (ROOT / "recipes/train_deepspeed.py").read_text()
    for rel in ("benchmarks/bench_mfu.py", "scripts/cluster_step.py"):
        assert "run_trial_step" in (ROOT / rel).read_text(), rel


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
            f"--engram.nvme_dirs={folder}/pages", "--engram.nvme_create_dirs=true",
            "--engram.nvme_host_cache_gib=0.002",
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
    before runs, and step 3 the next (a trial knows no last step); before, the tools timed NVMe
    configs without the page-in training has."""
    from launcher import run_distributed

    (stores,) = run_distributed(_trial_pages, 1, str(tmp_path))
    assert stores, "the cut has an NVMe table"
    for pins, page_ins in stores:
        assert pins == 3 and page_ins == 3, (pins, page_ins)
