"""Pipeline parallelism: stage splits, schedule checks, and run-level parity with one process.

Parity (the bar of tests/test_parallelisms_parity.py, whose helpers this reuses): the debug model (4 layers) on
the same global batch of 8 sequences, 3 steps (2 with TP or float8, below); per-step losses to
rtol 1e-5, step-1 gradient norm to 1e-6,
updated weights per tensor (the union over the pipeline ranks), and the held-out loss. Engram
layers [0, 2] put an Engram block on both stages at pp 2 (and on stages 0 and 2 of 4 with two
virtual stages per rank); single-layer placements put it on stage 0 only or on stage 1 only.
"""

from __future__ import annotations

import json

import pytest
import torch
from launcher import run_distributed
from shared_runs import shared_run
from test_parallelisms_parity import _assert_matches, _initial_weights, _parity_config, _with
from torch.distributed.tensor import DTensor

from engram.config import ConfigError, Pipeline, config_from_dict
from engram.data.tokenizer import load_tokenizer
from engram.models.builder import build_from_config
from engram.models.transformer import clean_fqn
from parallelisms.pipeline import check_schedule, plan_stages, prune_to_stage, stage_ranks

GLOBAL_BATCH = 8


# ----------------------------------------------------------------------------- splits (no ranks)


def test_even_split_and_loop_placement():
    plan = plan_stages(8, Pipeline(schedule="Interleaved1F1B", virtual_stages=2), pp=2)
    assert plan.layers == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.ranks == [0, 1, 0, 1]
    assert plan.local_stages(1) == [1, 3]


def test_v_placement_puts_first_and_last_stage_on_rank_0():
    assert stage_ranks(4, 2, "ZBVZeroBubble") == [0, 1, 1, 0]
    assert stage_ranks(6, 3, "DualPipeV") == [0, 1, 2, 2, 1, 0]
    plan = plan_stages(4, Pipeline(schedule="DualPipeV", virtual_stages=2), pp=2)
    assert plan.last_stage_rank == 0


def test_uneven_splits():
    plan = plan_stages(7, Pipeline(layers_per_stage=4), pp=2)
    assert plan.layers == [[0, 1, 2, 3], [4, 5, 6]]
    plan = plan_stages(8, Pipeline(split_points=["layers.3", "layers.6"], schedule="GPipe"), pp=3)
    assert plan.layers == [[0, 1, 2], [3, 4, 5], [6, 7]]


@pytest.mark.parametrize(
    "n_layers, pipeline, pp, needle",
    [
        (5, {}, 2, "do not split evenly"),
        (8, {"layers_per_stage": 3}, 2, "splits 8 layers into 3 stages"),
        (8, {"split_points": ["layers.4", "layers.6"]}, 2, "need 1"),
        (8, {"split_points": ["norm"]}, 2, "names no module"),
        (8, {"split_points": ["layers.9"]}, 2, "names no module"),
        (8, {"split_points": ["layers.0"]}, 2, "names no module"),
        (8, {"split_points": ["layers.5", "layers.3", "layers.6"]}, 4, "strictly increasing"),
    ],
)
def test_bad_splits_name_the_fix(n_layers, pipeline, pp, needle):
    with pytest.raises(ConfigError, match=needle):
        plan_stages(n_layers, Pipeline(**pipeline), pp)


@pytest.mark.parametrize(
    "pipeline, pp, batch, needle",
    [
        ({"schedule": "Interleaved1F1B"}, 2, 8, "needs virtual stages"),
        ({"schedule": "LoopedBFS"}, 2, 8, "needs virtual stages"),
        ({"schedule": "1F1B", "virtual_stages": 2}, 2, 8, "one stage per rank"),
        ({"schedule": "ZBVZeroBubble", "virtual_stages": 3}, 2, 12, "virtual_stages = 2"),
        ({"schedule": "1F1B", "microbatches": 2}, 4, 8, "at least 4 micro-batches"),
        (
            {"schedule": "DualPipeV", "virtual_stages": 2, "microbatches": 2},
            2,
            8,
            "at least 4 micro-batches",
        ),
        ({"schedule": "GPipe", "microbatches": 3}, 2, 8, "does not divide"),
        ({"schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 9}, 4, 18, "rounds"),
    ],
)
def test_bad_schedule_settings_name_the_fix(pipeline, pp, batch, needle):
    with pytest.raises(ConfigError, match=needle):
        check_schedule(Pipeline(**pipeline), pp, batch)


def test_default_microbatches_one_per_stage():
    assert check_schedule(Pipeline(schedule="1F1B"), 2, 8) == 2
    assert check_schedule(Pipeline(schedule="ZBVZeroBubble", virtual_stages=2), 2, 8) == 4


def test_unknown_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="pipeline.schedule must be one of"):
        Pipeline(schedule="Chimera")


def test_pruned_stages_keep_global_names_and_partition_the_model():
    cfg = config_from_dict({"model": {"flavor": "debug"}, "engram": {"layer_ids": [0, 2]}})
    model, _ = build_from_config(cfg, load_tokenizer(""))
    plan = plan_stages(model.args.n_layers, Pipeline(), pp=2)
    parts = [prune_to_stage(model, plan, s) for s in range(2)]
    names = [{n for n, _ in part.named_parameters()} for part in parts]
    assert not names[0] & names[1]
    assert names[0] | names[1] == {n for n, _ in model.named_parameters()}
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[1]
    assert any(n.startswith("layers.2.engram.") for n in names[1])
    assert list(parts[1].layers.keys()) == ["2", "3"]
    assert parts[0].output is None and parts[1].tok_embeddings is None


# ----------------------------------------------------------------------------- parity (gloo ranks)


def _train(rank: int, world: int, raw: dict) -> dict:
    from recipes.train import train

    result = train(config_from_dict(raw))
    weights = {}
    for part in result.model_parts:  # this rank's stages; the test takes the union over ranks
        for name, p in part.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            weights[clean_fqn(name)] = full.detach().clone()
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "weights": weights,
        "eval": result.eval_losses,
    }


def _raw(folder, world: int, layout: dict, extra: dict) -> dict:
    # The parity file's steps (PARITY_STEPS): a schedule that mis-orders micro-batches or loses a
    # stage's gradient is off from step 1, an optimizer state kept per stage from step 2 on.
    raw = _with(_parity_config(str(folder), world, "full", layout), extra)  # extra may set steps
    dp = world // layout.get("pp", 1) // layout.get("tp", 1)
    raw["training"]["local_batch_size"] = GLOBAL_BATCH // dp
    raw["data"]["eval_batches"] = 2  # held-out loss at the last step, under PP too
    return raw


def _check_layouts(
    tmp_path,
    layouts: dict,
    extra: dict,
    ref_training: dict | None = None,
    ref_drop: tuple[str, ...] = (),
    grad_rtol: float = 1e-3,
) -> None:
    """Each layout vs one single-process reference (`ref_training` overrides its [training]; it
    runs without the sections `ref_drop` names, at their defaults)."""
    ref_raw = _raw(tmp_path / "ref", 1, {}, {k: v for k, v in extra.items() if k not in ref_drop})
    ref_raw["training"].update(ref_training or {})
    # The held-out loss over the same 16 sequences when the reference's batch is smaller.
    ref_raw["data"]["eval_batches"] = 2 * GLOBAL_BATCH // ref_raw["training"]["local_batch_size"]
    ref = shared_run(_train, 1, ref_raw)[0]
    init = _initial_weights(ref_raw)
    for label, (world, layout, pipeline) in layouts.items():
        raw = _raw(tmp_path / label, world, layout, {**extra, "pipeline": pipeline})
        out = run_distributed(_train, world, raw)
        merged = {k: v for o in out for k, v in o["weights"].items()}
        for rank, got in enumerate(out):
            where = f"{label} (world {world}, rank {rank})"
            _assert_matches({**got, "weights": merged}, ref, init, where, grad_rtol)
            torch.testing.assert_close(
                torch.tensor(list(got["eval"].values())),
                torch.tensor(list(ref["eval"].values())),
                rtol=1e-5,
                atol=0,
                msg=where,
            )


SCHEDULES = {
    "gpipe": (2, {"pp": 2}, {"schedule": "GPipe"}),
    "1f1b": (2, {"pp": 2}, {"schedule": "1F1B", "microbatches": 4}),
    "interleaved_1f1b": (2, {"pp": 2}, {"schedule": "Interleaved1F1B", "virtual_stages": 2}),
    "looped_bfs": (2, {"pp": 2}, {"schedule": "LoopedBFS", "virtual_stages": 2}),
    "interleaved_zb": (2, {"pp": 2}, {"schedule": "InterleavedZeroBubble", "virtual_stages": 2}),
    "zbv": (2, {"pp": 2}, {"schedule": "ZBVZeroBubble", "virtual_stages": 2}),
    "dualpipev": (2, {"pp": 2}, {"schedule": "DualPipeV", "virtual_stages": 2}),
    "pp2_fsdp2": (4, {"pp": 2, "dp_shard": 2}, {"schedule": "1F1B"}),
    "pp2_hsdp2x2": (8, {"pp": 2, "dp_replicate": 2, "dp_shard": 2}, {"schedule": "1F1B"}),
}


@pytest.mark.slow
def test_schedules_match_single_process(tmp_path):
    """Every schedule at pp 2, Engram on both stages (loop and v placements); PP x FSDP2."""
    _check_layouts(tmp_path, SCHEDULES, {})


COMPOSED = {
    "pp2_tp2": (4, {"pp": 2, "tp": 2, "dp_shard": 1}, {"schedule": "Interleaved1F1B",
                                                        "virtual_stages": 2}),
    "pp2_hsdp2_tp2": (8, {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 2},
                      {"schedule": "ZBVZeroBubble", "virtual_stages": 2}),
    "pp2_fsdp2_tp2": (8, {"pp": 2, "dp_shard": 2, "tp": 2}, {"schedule": "1F1B"}),
}  # fmt: skip


# With TP the forward's own fp32 summation order changes, which Adam and the Engram gate amplify
# after a few steps (measured by tests/test_parallelisms_tp.py on the tp branch: grad norms of steps 3-5 drift
# up to 2.4e-3 without PP; here pp2 x tp2 step 5 drifted 1.05e-3). Compare the first 2 steps,
# as test_parallelisms_tp.py does.
TP_STEPS = 2


@pytest.mark.slow
def test_tp_layouts_match_single_process(tmp_path):
    """PP x TP (sequence + loss parallel, interleaved), PP x DP x TP (8 ranks, "v" placement):
    tables over each stage's dp x tp ranks."""
    _check_layouts(tmp_path, COMPOSED, {"training": {"steps": TP_STEPS}})


@pytest.mark.slow
@pytest.mark.parametrize("layer_id, stage", [(1, 0), (3, 1)])
def test_engram_on_one_stage(tmp_path, layer_id, stage):
    """One Engram layer, on the first or on the last stage only; grad accumulation under PP.

    The reference runs the same sub-batches of 4 sequences (local batch 4 x 4 accumulation
    steps vs 8 x 2 with 2 micro-batches): one process with 8 x 2 instead already differs from
    4 x 4 by 1.06e-2 (relative update) in layer 3's Engram key projection, Adam amplifying
    fp32 summation order in near-zero gradient entries."""
    layouts = {f"engram_stage{stage}": (2, {"pp": 2}, {"schedule": "1F1B"})}
    extra = {"engram": {"layer_ids": [layer_id]}, "training": {"grad_accum_steps": 2}}
    _check_layouts(tmp_path, layouts, extra, {"local_batch_size": 4, "grad_accum_steps": 4})


@pytest.mark.slow
def test_pp_fsdp_with_checkpointing_and_compile(tmp_path):
    """PP 2 x FSDP 2 with full activation checkpointing and every block compiled (aot_eager:
    inductor's per-process compile would dominate CI, see tests/test_parallelisms_compile.py) against one
    eager process without either (test_schedules_match_single_process's reference): recompute
    and compile change no number."""
    layouts = {"pp2_fsdp2_ac_compile": (4, {"pp": 2, "dp_shard": 2}, {"schedule": "1F1B"})}
    extra = {
        "activation_checkpoint": {"mode": "full"},
        "compile": {"enable": True, "backend": "aot_eager"},
    }
    _check_layouts(
        tmp_path,
        layouts,
        extra,
        ref_drop=("activation_checkpoint", "compile"),
    )


@pytest.mark.slow
def test_pp_with_float8(tmp_path):
    """float8 (emulated, rowwise) under PP 2 against one float8 process: one micro-batch per
    step (GPipe), so every float8 scale covers the same tokens as in the reference. Two steps:
    fp32 rounding-level differences (e.g. the grad norm is summed over pp in another order) are
    amplified once a value crosses a float8 rounding boundary: measured 1.5e-5 (loss, step 5)
    and 2.8e-4 (grad norm, step 4) relative, as with TP (tests/test_parallelisms_float8.py)."""
    layouts = {"pp2_float8": (2, {"pp": 2}, {"schedule": "GPipe", "microbatches": 1})}
    extra = {"float8": {"enable": True, "emulate": True}, "training": {"steps": TP_STEPS}}
    _check_layouts(tmp_path, layouts, extra)


@pytest.mark.slow
def test_pp_tp_float8_matches_tp_float8(tmp_path):
    """float8 x PP x TP: PP 2 x TP 2 against TP 2 alone (both float8, emulated rowwise, one
    micro-batch). Not against one process: under TP each rank computes rowwise float8 scales
    over its own feature shard, which changes the quantization (TP 2 alone vs one process:
    the embedding's update differs by 1.7e-2 relative after 2 steps, losses agree to 1e-5), so
    the reference must have the same TP layout; what PP may not change is measured here."""
    extra = {"float8": {"enable": True, "emulate": True}, "training": {"steps": TP_STEPS}}
    ref_raw = _raw(tmp_path / "tp2", 2, {"tp": 2, "dp_shard": 1}, extra)
    ref = run_distributed(_train, 2, ref_raw)[0]
    init = _initial_weights(_raw(tmp_path / "init", 1, {}, extra))
    pipeline = {"schedule": "GPipe", "microbatches": 1}
    raw = _raw(
        tmp_path / "pp2_tp2", 4, {"pp": 2, "tp": 2, "dp_shard": 1}, {**extra, "pipeline": pipeline}
    )
    out = run_distributed(_train, 4, raw)
    merged = {k: v for o in out for k, v in o["weights"].items()}
    for rank, got in enumerate(out):
        _assert_matches({**got, "weights": merged}, ref, init, f"pp2 x tp2 float8 (rank {rank})")


def _resume_raw(folder, load_step: int) -> dict:
    raw = _raw(folder, 4, {"pp": 2, "dp_shard": 2}, {"pipeline": {"schedule": "1F1B"}})
    raw["job"]["run_name"] = "pp-resume"
    raw["training"]["steps"] = 4
    raw["data"]["eval_batches"] = 0
    raw["checkpoint"] = {"enable": True, "interval": 2, "keep_latest_k": 0, "load_step": load_step}
    return raw


@pytest.mark.slow
def test_dcp_resume_under_pp_fsdp_replays_losses(tmp_path):
    full = run_distributed(_train, 4, _resume_raw(tmp_path, -1))
    resumed = run_distributed(_train, 4, _resume_raw(tmp_path, 2))
    for rank in range(4):
        assert resumed[rank]["losses"] == full[rank]["losses"][2:], f"rank {rank}"
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "pp-resume" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-2:] == [3, 4]


def test_hf_backbone_loads_into_each_stage(tmp_path):
    """Each pipeline stage reads only its own layers from the HF folder; together they equal
    the exported backbone, and a tensor missing for a stage's own layer is still an error."""
    from test_hf_load import SEED_A, SEED_B, _build, _init, _raw, _weights, export_hf

    from engram.hf.load import HFLoadError, load_hf_backbone

    source, _ = _init(_raw(), SEED_A)
    export_hf(source, tmp_path / "hf")
    want = _weights(source)
    meta, _ = _build(_raw())
    plan = plan_stages(meta.args.n_layers, Pipeline(), pp=2)
    for stage in range(2):
        part = prune_to_stage(meta, plan, stage)
        part.to_empty(device="cpu")
        part.init_weights(seed=SEED_B)
        load_hf_backbone(part, tmp_path / "hf", part.args)
        for name, w in _weights(part).items():
            if ".engram." not in f".{name}":
                assert torch.equal(w, want[name]), name
    export_hf(source, tmp_path / "hf_missing", drop="model.layers.3.mlp.up_proj.weight")
    last = prune_to_stage(meta, plan, 1)
    last.to_empty(device="cpu")
    last.init_weights(seed=SEED_B)
    with pytest.raises(HFLoadError, match=r"layers\.3\.feed_forward\.w3\.weight"):
        load_hf_backbone(last, tmp_path / "hf_missing", last.args)
    first = prune_to_stage(meta, plan, 0)  # stage 0 does not hold layer 3: loads fine
    first.to_empty(device="cpu")
    first.init_weights(seed=SEED_B)
    load_hf_backbone(first, tmp_path / "hf_missing", first.args)


def test_tied_embeddings_are_refused_under_pp():
    from parallelisms.pipeline import split_stages

    cfg = config_from_dict({"model": {"flavor": "debug"}, "parallelism": {"pp": 2}})
    model, _ = build_from_config(cfg, load_tokenizer(""))
    model.args = model.args.replace(tie_embeddings=True)
    with pytest.raises(ConfigError, match="tied input/output embeddings"):
        split_stages(model, cfg, dims=None)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_split_backward_schedules_refuse_row_sparse_tables(schedule):
    """Their weight-gradient pass asks autograd for every parameter's gradient; a row-sparse
    table has none (torch raised "appears to not have been used in the graph")."""
    from parallelisms.pipeline import split_stages

    raw = {
        "model": {"flavor": "debug"},
        "parallelism": {"pp": 2},
        "pipeline": {"schedule": schedule, "virtual_stages": 2},
        "optimizer": {"table_optimizer": "lazy_adam"},
    }
    cfg = config_from_dict(raw)
    model, _ = build_from_config(cfg, load_tokenizer(""))
    with pytest.raises(ConfigError, match='use optimizer.table_optimizer = "adam"'):
        split_stages(model, cfg, dims=None)


@pytest.mark.slow
def test_engram_only_under_pp(tmp_path):
    """engram_only trains the Engram parameters of both stages (frozen backbone bit-identical);
    a stage left without any trainable parameter is refused with the fix."""
    extra = {"training": {"mode": "engram_only"}}
    # Grad norms: measured <= 1.7e-4 relative over steps 1-4, 1.2e-3 at step 5 (the
    # micro-batches sum the gradients in another fp32 order and Engram's signed-sqrt gate
    # amplifies that: docs/parallelisms.md, "TP and the Engram gate"), so 3 steps at the usual
    # bounds.
    layouts = {"pp2_engram_only": (2, {"pp": 2}, {"schedule": "1F1B"})}
    _check_layouts(tmp_path, layouts, extra)
    raw = _raw(tmp_path / "bad", 2, {"pp": 2}, {**extra, "engram": {"layer_ids": [0]}})
    with pytest.raises(RuntimeError, match="leaves a pipeline stage without trainable"):
        run_distributed(_train, 2, raw)
