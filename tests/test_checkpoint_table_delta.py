"""Incremental Engram table checkpoints (checkpoint.table_full_every, engram/checkpoint/
table_delta.py) with host tables and lazy_adam, saving at every step: a resume from a delta
step equals the uninterrupted run bitwise (losses, every table row), also at another world
size, where it equals a resume from a full checkpoint of the same step; a deleted delta file is
refused by name; keep_latest_k keeps the chain; a delta of a step that touched ~1% of the rows
is ~1% of a full table checkpoint (measured, printed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from launcher import in_turn, run_distributed
from tables_twins import table_raw
from test_parallelisms_host_tables import _same, _train
from test_parallelisms_nvme_tables import _train as _nvme_train

from engram.config import ConfigError, config_from_dict

# ~100k table rows: a step's <= 1024 lookups touch ~1% of them.
VOCAB = [25013, 24989]


def _job(
    tmp, name: str, world: int, steps: int, full_every: int, load_step=-1, keep=0, where="host"
):
    raw = table_raw(str(tmp), name, world, where, "lazy_adam",
               {"engram": {"vocab_size_per_ngram": VOCAB}})  # fmt: skip
    raw["training"]["steps"] = steps
    raw["checkpoint"] = {"enable": True, "interval": 1, "keep_latest_k": keep,
                         "load_step": load_step, "table_full_every": full_every}  # fmt: skip
    return raw


def _steps(tmp, name: str, where: str = "host") -> list[str]:
    folder = tmp / f"{name}_{where}" / "checkpoint"
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step-"))


def _read_one_process(tmp, name: str) -> dict:
    from engram.checkpoint import find_checkpoint, load_model_checkpoint
    from engram.checkpoint.fingerprint import config_fingerprint
    from engram.data.tokenizer import load_tokenizer
    from engram.models.builder import build_for_inference

    cfg = config_from_dict(_job(tmp, name, 1, 3, 1))
    tok = load_tokenizer("")
    model, hasher = build_for_inference(cfg, tok, 16)
    path = find_checkpoint(cfg.run_folder / cfg.checkpoint.folder, 3)
    load_model_checkpoint(model, path, config_fingerprint(cfg, tok, hasher))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_equal(got: list[dict], want: list[dict], first: int, label: str) -> None:
    for g, w in zip(got, want, strict=True):
        assert _same(g["losses"], w["losses"][first:]), (label, g["losses"], w["losses"])
        assert g["tables"].keys() == w["tables"].keys() and g["tables"]
        for n, t in w["tables"].items():
            assert np.array_equal(g["tables"][n], t), f"{label}: table {n} differs"


@pytest.mark.slow
@pytest.mark.parametrize(
    "where, mode", [("host", "disabled"), ("device", "disabled"), ("host", "async")]
)
def test_resume_from_delta_is_bitwise_and_prune_keeps_the_chain(tmp_path, where, mode):
    """1 rank, 6 steps saved at every step with a base every 3 saves (1 base, 2-3 deltas, 4
    base, ...). Resumed from step 3 (base 1 + deltas 2, 3): steps 4-6 equal the uninterrupted
    run. The resumed run keeps 1 checkpoint: step 6 needs 4 (base) and 5, so 4-6 stay. `mode`:
    checkpoint.async_mode of the first run (a delta's DCP part written in the background)."""
    raw = _job(tmp_path, "inc", 1, 6, 3, where=where)
    raw["checkpoint"]["async_mode"] = mode
    whole = run_distributed(_train, 1, raw)
    folder = tmp_path / f"inc_{where}" / "checkpoint"
    delta = sum(f.stat().st_size for f in (folder / "step-2").glob("table_delta.rank*.pt"))
    rows = sum(t.shape[0] for t in whole[0]["tables"].values())
    dim = next(iter(whole[0]["tables"].values())).shape[1]
    full = rows * dim * 4 * 3  # fp32 rows + lazy Adam's two moments
    files = (folder / "step-2").glob("table_delta.rank*.pt")
    touched = sum(v.numel() for f in files for k, v in torch.load(f).items() if k.endswith("/rows"))
    print(
        f"step 2 touched {touched} of {rows} rows ({touched / rows:.2%}); its table delta: "
        f"{delta} B = {delta / full:.4f} of a full table save ({full} B)"
    )
    assert delta / full < 0.03
    resumed = run_distributed(
        _train, 1, _job(tmp_path, "inc", 1, 6, 3, load_step=3, keep=1, where=where)
    )
    _assert_equal(resumed, whole, 3, f"{where}: resume from delta step 3")
    assert _steps(tmp_path, "inc", where) == ["step-4", "step-5", "step-6"]


@pytest.mark.slow
def test_delta_resumes_at_another_world_size_and_missing_delta_is_refused(tmp_path):
    """Saved by 2 ranks (steps 1-3: base 1, deltas 2 and 3), resumed by 1 and by 2 ranks from
    delta step 3: equal to the same resume from a full checkpoint of step 3 of the same 2-rank
    run. Then a deleted delta file of step 2 is refused by name. (The delta and the full run
    train one after the other in one launch, each resume pair too; one step after the resume.)"""
    saves = [("inc2", 3), ("full2", 1)]  # run name, checkpoint.table_full_every
    run_distributed(
        in_turn, 2, _train, [_job(tmp_path, name, 2, 3, every) for name, every in saves]
    )
    assert _steps(tmp_path, "inc2") == ["step-1", "step-2", "step-3"]
    for world in (1, 2):  # 2 -> 1 ranks, and 2 -> 2 ranks
        resumes = [_job(tmp_path, name, world, 4, 1, 3) for name, _ in saves]
        from_delta, from_full = zip(*run_distributed(in_turn, world, _train, resumes), strict=True)
        _assert_equal(from_delta, from_full, 0, f"2 -> {world} ranks from delta step 3")
    # one process (generation, export) reads delta step 3 as the full step 3
    read = {name: _read_one_process(tmp_path, name) for name in ("inc2", "full2")}
    assert read["inc2"].keys() == read["full2"].keys()
    for n, t in read["full2"].items():
        assert torch.equal(read["inc2"][n], t), f"one-process read of delta step 3: {n} differs"
    (tmp_path / "inc2_host" / "checkpoint" / "step-2" / "table_delta.rank1.pt").unlink()
    with pytest.raises(Exception, match=r"step-2 \(a delta\).*table_delta\.rank1\.pt is missing"):
        run_distributed(_train, 1, _job(tmp_path, "inc2", 1, 4, 3, load_step=3))


def test_table_full_every_needs_a_row_sparse_table_optimizer():
    with pytest.raises(ConfigError, match="needs Engram tables with a row-sparse"):
        config_from_dict({"checkpoint": {"table_full_every": 2}})  # dense adam tables
    from runner.deepspeed_engine import check_layout

    cfg = config_from_dict(
        {"checkpoint": {"table_full_every": 2}, "optimizer": {"table_optimizer": "lazy_adam"}}
    )
    with pytest.raises(ConfigError, match="table_full_every = 2 is not supported by recipes"):
        check_layout(cfg)
    with pytest.raises(ConfigError, match="must be >= 1"):
        config_from_dict({"checkpoint": {"table_full_every": 0}})


@pytest.mark.slow
def test_nvme_tables_resume_from_delta_bitwise(tmp_path):
    """NVMe tables (a host cache of 5 MiB, below the ~19 MB of rows and moments): 4 steps
    saved at every step with a base every 2 saves, resumed from delta step 2 in fresh page
    files: steps 3-4 equal the uninterrupted run."""

    def job(load_step: int) -> dict:
        raw = _job(tmp_path, "nvme", 1, 4, 2, load_step=load_step)
        raw["engram"] |= {"table_location": "nvme", "nvme_dirs": [str(tmp_path / f"pages{load_step}")],
                          "nvme_create_dirs": True, "nvme_host_cache_gib": 5 / 1024}  # fmt: skip
        return raw

    whole = run_distributed(_nvme_train, 1, job(-1))  # its tables: read from the store
    resumed = run_distributed(_nvme_train, 1, job(2))
    _assert_equal(resumed, whole, 2, "nvme resume from delta step 2")


def test_chain_problems_name_a_missing_or_replaced_step(tmp_path):
    """The chain check alone (no launch): a missing step folder and a step saved again since
    (another manifest) are named with the base to resume from."""
    from engram.checkpoint.folder import file_checksum
    from engram.checkpoint.table_delta import chain_problems, chain_record

    def step_dir(s: int):
        return tmp_path / f"step-{s}"

    for s in (4, 5):
        step_dir(s).mkdir()
        (step_dir(s) / "manifest.json").write_text(f'{{"step": {s}}}')

    def crc(folder):
        try:
            return file_checksum(folder / "manifest.json")
        except OSError:
            return None

    manifest = {"table_chain": chain_record([4, 5, 6], lambda s: crc(step_dir(s)))}
    assert chain_problems(step_dir(6), manifest, step_dir, crc, lambda f: []) == []
    (step_dir(5) / "manifest.json").write_text('{"step": 5, "saved": "again"}')
    (problem,) = chain_problems(step_dir(6), manifest, step_dir, crc, lambda f: [])
    assert "step-5 (a delta) was replaced since" in problem and "load_step = 4" in problem
    (step_dir(4) / "manifest.json").unlink()
    problems = chain_problems(step_dir(6), manifest, step_dir, crc, lambda f: [])
    assert "needs step-4 (its base), whose folder" in problems[0]


@pytest.mark.slow
@pytest.mark.parametrize("layers", [[0, 2], [1]])
def test_pipeline_stages_resume_from_delta_bitwise(tmp_path, layers):
    """PP 2 (each stage writes the delta rows of its own tables; [1]: one stage has none):
    4 steps saved at every step with a base every 3 saves, resumed from delta step 3: step 4
    equals the uninterrupted run."""

    def job(load_step: int) -> dict:
        raw = _job(tmp_path, "pp", 2, 4, 3, load_step=load_step)
        raw["parallelism"] = {"dp_shard": 1, "pp": 2}
        raw["pipeline"] = {"schedule": "1F1B", "microbatches": 2}
        raw["engram"]["layer_ids"] = layers
        raw["training"]["local_batch_size"] = 8
        return raw

    whole = run_distributed(_train, 2, job(-1))
    resumed = run_distributed(_train, 2, job(3))
    for g, w in zip(resumed, whole, strict=True):
        assert _same(g["losses"], w["losses"][3:]), (g["losses"], w["losses"])
        assert g["tables"].keys() == w["tables"].keys()
        for n, t in w["tables"].items():
            assert np.array_equal(g["tables"][n], t), f"PP {layers}: table {n} differs"
