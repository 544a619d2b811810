"""scripts/check_cluster.py, the cluster acceptance check, on CPU with real gloo ranks.

Passing runs use the fork launcher (one launch per world size, every check including --tp); the
failing run goes through the real launcher (run_train.sh + torchrun, TRAIN_SCRIPT override) with
ENGRAM_CHECK_INJECT making the harness reject the bf16 all-to-all the way a backend would: the
exit status must be non-zero and the table must name the setting to change.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[1]

spec = importlib.util.spec_from_file_location(
    "check_cluster", ROOT / "scripts" / "check_cluster.py"
)
check_cluster = importlib.util.module_from_spec(spec)
sys.modules["check_cluster"] = check_cluster  # dataclasses look their module up there
spec.loader.exec_module(check_cluster)

ALL_CHECKS = [
    "init",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all_single[int64]",
    "all_to_all_single[int32]",
    "all_to_all_single[bfloat16]",
    "all_to_all_single[float32]",
    "engram_lookup[float32]",
    "engram_lookup[bfloat16]",
    "fsdp2_bf16_step",
    "dcp_save_load",
    "bandwidth[intra-node]",
    "bandwidth[inter-node]",
    "bandwidth[world]",
    "tp_mlp",
    "real_step",
    "peak_memory",
]


def _rows(table: str) -> dict[str, str]:
    """{check name: PASS / FAIL / SKIP} from the printed table."""
    rows = {}
    for line in table.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ALL_CHECKS:
            rows[parts[0]] = parts[1]
    return rows


def _run(rank: int, world_size: int, argv: list[str]) -> tuple[int, str]:
    return check_cluster.run_checks(argv)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_check_passes_on_gloo(world_size: int, tmp_path: Path) -> None:
    argv = ["--job.device=cpu", f"--job.dump_folder={tmp_path}", "--tp", "--bandwidth-mib=1"]
    if world_size == 2:  # real_step: a cut of the 32B NPU config, at its layout (FSDP over all)
        argv.append(f"--job.config_file={ROOT / 'train_configs/32b_npu.toml'}")
    results = run_distributed(_run, world_size, argv)
    assert [status for status, _ in results] == [0] * world_size, results[0][1]
    table = results[0][1]
    assert all(text == "" for _, text in results[1:])  # only rank 0 prints
    rows = _rows(table)
    assert list(rows) == ALL_CHECKS, table
    expected = {name: "PASS" for name in ALL_CHECKS}
    expected["bandwidth[inter-node]"] = "SKIP"  # one host
    assert rows == expected, table
    assert f"check_cluster: {world_size} ranks on 1 host(s), device cpu, backend gloo" in table
    assert "RESULT: PASS" in table
    assert not any((tmp_path / "check_cluster").iterdir())  # the DCP scratch folder is removed
    step = next(line for line in table.splitlines() if line.startswith("real_step"))
    assert "cut to 2 layers" in step and "cpu: widths / 16" in step, step
    assert "TFLOP/s per device" in step and "MFU" in step, step
    assert re.search(r"vs planner \d+\.\d+ GiB: ratio \d+\.\d+", step), step
    if world_size == 2:
        assert "qwen2/32B cut to 2 layers, Engram at layer 1; dim 320, 5 heads" in step, step


@pytest.mark.slow
def test_rejected_bf16_all_to_all_fails_and_names_the_setting(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TRAIN_SCRIPT": "scripts/check_cluster.py",
        "NGPU": "2",
        "MASTER_PORT": str(free_port()),
        "LOG_RANK": "0",
        "PYTHONPATH": str(ROOT),
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        check_cluster.INJECT_ENV: "all_to_all_single[bfloat16]",
    }
    proc = subprocess.run(
        [
            "./run_train.sh",
            "--job.device=cpu",
            f"--job.dump_folder={tmp_path}",
            "--bandwidth-mib=1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    table = "\n".join(line.removeprefix("[rank0]:") for line in out.splitlines())
    rows = _rows(table)
    assert rows["all_to_all_single[bfloat16]"] == "FAIL", table
    assert "simulated backend rejection" in table
    assert (
        'fix: the Engram table all-to-all carries rows in this dtype: set parallelism.engram_a2a_dtype = "float32"'
        in table
    )
    assert "RESULT: FAIL (1 of 18: all_to_all_single[bfloat16])" in table
    # Every other check still ran (the failure did not stop the table).
    assert {n: s for n, s in rows.items() if s == "PASS"}.keys() == set(ALL_CHECKS) - {
        "all_to_all_single[bfloat16]",
        "bandwidth[inter-node]",
        "tp_mlp",
    }


def test_unknown_config_key_is_rejected_before_any_rank_starts() -> None:
    with pytest.raises(Exception, match="unknown key job.devise"):
        check_cluster.parse_args(["--job.devise=cpu"])


def test_setting_hints_cover_every_check() -> None:
    assert set(check_cluster.FIXES) == set(ALL_CHECKS)
    assert all(check_cluster.FIXES[name] for name in ALL_CHECKS if name != "peak_memory")


def _real_step_seen(rank: int, world_size: int, layouts: list[list[str]]) -> list[tuple]:
    """check_cluster's real_step once per layout, counting what each rank's model embeds: a
    forward pre-hook on every part's token embedding records the [batch, tokens] it is given."""
    import torch

    from engram.config import load_config
    from runner import trial_step
    from scripts.cluster_step import real_step

    build = trial_step.build_model_parts
    out = []
    for argv in layouts:
        seen: list[tuple[int, ...]] = []

        def counted(*args, seen=seen):
            parts, loss_fn, pp = build(*args)
            for part in parts:
                if getattr(part, "tok_embeddings", None) is not None:
                    part.tok_embeddings.register_forward_pre_hook(
                        lambda _, inputs: seen.append(tuple(inputs[0].shape))
                    )
            return parts, loss_fn, pp

        trial_step.build_model_parts = counted
        row = real_step(load_config(argv), argv, torch.device("cpu"), 2)
        out.append((row, seen))
    return out


@pytest.mark.slow
def test_real_step_cuts_the_sequence_at_cp2_and_runs_a_pipeline(tmp_path: Path) -> None:
    """real_step is the recipe's one step (runner/step.py): at cp = 2 each rank's model sees
    seq / 2 tokens of every sample (before, each rank ran the whole sequence), and a pp = 2
    layout runs its schedule (before, it was refused)."""
    common = ["--job.device=cpu", f"--job.dump_folder={tmp_path}"]
    cp2 = [f"--job.config_file={ROOT / 'train_configs/debug_cp.toml'}", *common]
    pp2 = [f"--job.config_file={ROOT / 'train_configs/debug_pp.toml'}", *common]
    results = run_distributed(_real_step_seen, 2, [cp2, pp2])
    (cp_row, cp_seen_0), (pp_row, pp_seen_0) = results[0]
    (_, cp_seen_1), (_, pp_seen_1) = results[1]
    # cp 2, seq 128 (the debug config's), batch 1 on cpu: two steps of [1, 64] on each rank
    assert "seq 128, batch 1" in cp_row and "TFLOP/s per device" in cp_row, cp_row
    assert cp_seen_0 == cp_seen_1 == [(1, 64)] * 2
    # pp 2, 1F1B over 4 micro-batches (batch 4 on cpu): the first stage embeds [1, 128] per
    # micro-batch, 4 per step (plus torch's shape inference at the first), the second stage has
    # no embedding
    assert "seq 128, batch 4" in pp_row and "TFLOP/s per device" in pp_row, pp_row
    assert set(pp_seen_0) == {(1, 128)} and len(pp_seen_0) >= 8, pp_seen_0
    assert pp_seen_1 == []
