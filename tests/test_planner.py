"""The memory planner (planner/) under pipeline parallelism, communication and layouts: per-stage
bytes against what real gloo ranks hold after a real optimizer step, micro-batches in flight
against torch's schedules, and --compare on the 32B config at 64 ranks."""

from __future__ import annotations

import pytest
import torch
from launcher import run_distributed, run_isolated
from planner_runs import planned
from small_job import load_shipped

from engram.config import PIPELINE_SCHEDULES, ConfigError
from engram.models.args import get_model_args
from parallelisms.pipeline import V_SHAPED, stage_ranks
from planner.activations import activation_estimate
from planner.cli import main
from planner.estimate import estimate
from planner.layouts import default_layouts, layout_config, parse_layout
from planner.schedule import bubble_fraction, in_flight

DEBUG = "train_configs/debug_model.toml"
NPU_32B = "train_configs/32b_npu.toml"


def _cfg(path: str, *overrides: str):
    return load_shipped(path, *overrides)


# --------------------------------------------------------------------------- in flight


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4)])
def test_single_stage_schedules_hold_the_textbook_micro_batches(pp, m):
    """GPipe keeps every micro-batch of the step; 1F1B keeps min(m, pp - r) on pp rank r."""
    for r in range(pp):
        gpipe = in_flight("GPipe", pp, 1, m, r, {r: 10})
        assert gpipe.micro_batches == {r: m} and gpipe.peak_bytes == 10 * m
        one_f_one_b = in_flight("1F1B", pp, 1, m, r, {r: 10})
        assert one_f_one_b.micro_batches == {r: min(m, pp - r)}
        assert one_f_one_b.peak_bytes == 10 * min(m, pp - r)


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_every_schedule_frees_what_it_saves(schedule):
    """Every forward is freed by a full backward or a weight-gradient step, the peak lies between
    one micro-batch of one stage and everything, and multi-stage schedules keep less than GPipe
    would with the same stages."""
    pp, m = 4, 8
    v = 1 if schedule in ("GPipe", "1F1B") else 2
    ranks = stage_ranks(pp * v, pp, schedule)
    for r in range(pp):
        local = {s: 1 << s for s, owner in enumerate(ranks) if owner == r}  # distinct bytes
        peak = in_flight(schedule, pp, v, m, r, local)
        assert min(local.values()) <= peak.peak_bytes <= m * sum(local.values())
        assert all(1 <= n <= m for n in peak.max_micro_batches.values())
        assert peak.peak_bytes == sum(local[s] * n for s, n in peak.micro_batches.items())
    if schedule in V_SHAPED:  # the "v": rank 0 holds the first and the last stage
        assert ranks[0] == ranks[-1] == 0


def test_bubble_fractions():
    assert bubble_fraction("GPipe", 4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("1F1B", 8, 1, 32) == pytest.approx(7 / 39)
    assert bubble_fraction("Interleaved1F1B", 4, 2, 8) == pytest.approx(3 / 19)
    assert bubble_fraction("ZBVZeroBubble", 4, 2, 8) == 0.0


def test_stage_activations_partition_the_model():
    """The stages' one-micro-batch activations add up to the whole model's (embedding ids on the
    first stage, final norm and loss on the last), for any split."""
    cfg = _cfg(DEBUG, "--activation_checkpoint.mode=none")
    args = get_model_args(cfg.model.name, cfg.model.flavor).replace(vocab_size=4096)
    whole = activation_estimate(cfg, args, "bfloat16")
    for bounds in ([0, 2, 4], [0, 1, 4], [0, 1, 2, 3, 4]):
        parts = [
            activation_estimate(
                cfg,
                args,
                "bfloat16",
                layers=list(range(a, b)),
                first=a == 0,
                last=b == args.n_layers,
            )
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        assert sum(p.saved_bytes for p in parts) == whole.saved_bytes
        assert sum(p.loss_bytes for p in parts) == whole.loss_bytes
        assert max(p.recompute_bytes for p in parts) == whole.recompute_bytes


# --------------------------------------------------------------------------- exact bytes


def _real_stage_bytes(rank: int, world: int, cfg) -> dict:
    """What a real rank holds: the recipe's build -> split_stages -> parallelize_model per stage,
    materialised, its optimizers stepped once (so their state exists)."""
    from engram.data.tokenizer import load_tokenizer
    from engram.models.builder import build_model_from_config
    from engram.optim.builder import apply_training_mode, build_optimizers
    from parallelisms.parallel_dims import parallel_dims_from_config
    from parallelisms.parallelize import parallelize_model
    from parallelisms.pipeline import split_stages

    dims = parallel_dims_from_config(cfg, world)
    dims.build_mesh("cpu")
    model = build_model_from_config(cfg, load_tokenizer(cfg.model.tokenizer_path).vocab_size)
    _, stage_ids, parts = split_stages(model, cfg, dims)
    tables = []
    for part in parts:
        tables += parallelize_model(part, cfg, dims)
        part.to_empty(device="cpu")
        part.init_weights(seed=0)
        apply_training_mode(part, cfg.training.mode)
    table_ids = {id(t) for t in tables}

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = [p for part in parts for p in part.parameters()]
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    grad_bytes = sum(local(p.grad).numel() * 4 for p in params if p.grad is not None)
    optimizers = [opt for part in parts for opt in build_optimizers(part, cfg)]
    for opt in optimizers:
        opt.step()
    state = sum(
        local(v).numel() * local(v).element_size()
        for opt in optimizers
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.dim() > 0  # Adam's step counter is a 0-d tensor
    )
    rows = {
        i: local(b.table.weight).shape[0] for part in parts for i, b in part.engram_blocks().items()
    }
    return {
        "stages": stage_ids,
        "dense": sum(local(p).numel() for p in params if id(p) not in table_ids),
        "rows": rows,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": state,
    }


@pytest.mark.parametrize(
    "world, layout",
    [
        (4, ("--parallelism.pp=2",)),  # PP2 x FSDP2
        (4, ("--parallelism.pp=2", "--parallelism.tp=2")),  # PP2 x TP2
        (  # two stages per rank, V placement: rank 0 holds the first and the last stage
            4,
            (
                "--parallelism.pp=2",
                "--pipeline.schedule=ZBVZeroBubble",
                "--pipeline.virtual_stages=2",
            ),
        ),
        (8, ("--parallelism.pp=2", "--parallelism.tp=2")),  # PP2 x FSDP2 x TP2
    ],
    ids=["pp2_fsdp2", "pp2_tp2", "pp2_v_fsdp2", "pp2_fsdp2_tp2"],
)
def test_per_stage_bytes_equal_what_real_ranks_hold(world, layout):
    """Parameters, table rows, gradients and optimizer state per rank from the estimator (fake
    process group) equal those of real gloo ranks after one optimizer step; Engram tables on
    two different stages."""
    cfg = _cfg(DEBUG, "--engram.layer_ids=[1, 2]", "--training.local_batch_size=4", *layout)
    est = run_isolated(estimate, cfg, world, ranks=list(range(world)))
    real = run_distributed(_real_stage_bytes, world, cfg)
    for mem, got in zip(est.ranks, real, strict=True):
        assert mem.stages == got["stages"], mem.rank
        assert mem.dense_params == got["dense"], mem.rank
        assert dict(mem.table_rows) == got["rows"], mem.rank
        assert mem.grad_bytes == got["grad_bytes"], mem.rank
        assert mem.optimizer_bytes == got["optimizer_bytes"], mem.rank
    assert est.all_ranks.dense_params_sum == sum(g["dense"] for g in real)
    for layer in (1, 2):
        assert est.all_ranks.table_rows[layer] == [g["rows"].get(layer, 0) for g in real]
    assert len({tuple(g["stages"]) for g in real}) == 2  # the two pp coordinates differ


def test_pipeline_keeps_parameters_and_gradients_unsharded_across_micro_batches():
    """Under PP x FSDP torch's stage neither reshards after backward nor reduce-scatters until
    the last micro-batch: all of a rank's layers are gathered and their unsharded gradients
    kept (fp32 reduce dtype), and activations count the schedule's micro-batches in flight."""
    cfg = _cfg(
        DEBUG, "--parallelism.pp=2", "--training.local_batch_size=8", "--pipeline.microbatches=4"
    )
    est = run_isolated(estimate, cfg, 4, ranks=[0, 2])
    first, last = est.ranks
    assert est.no_sync_accumulation
    for mem in est.ranks:
        f = mem.fsdp
        assert not f.layers_reshard_after_forward
        assert f.no_sync_accum_bytes > 0
    # 1F1B, pp 2, 4 micro-batches: stage 0 holds 2, stage 1 holds 1; only the last has a loss.
    assert first.activations.in_flight == {0: 2} and last.activations.in_flight == {1: 1}
    assert first.activations.loss_bytes == 0 < last.activations.loss_bytes
    per_mb = est.stage_activations
    assert first.activations.saved_bytes == 2 * per_mb[0].saved_bytes
    assert last.activations.saved_bytes == per_mb[1].saved_bytes
    assert per_mb[0].tokens == 2 * cfg.training.seq_len  # 8 sequences / 4 micro-batches
    assert first.comm.pp_send_recv == last.comm.pp_send_recv > 0


def test_bad_pipeline_settings_are_refused_by_the_estimator():
    cfg = _cfg(DEBUG, "--parallelism.pp=2", "--pipeline.microbatches=3")
    with pytest.raises(ConfigError, match="does not divide training.local_batch_size"):
        run_isolated(estimate, cfg, 2)
    cfg = _cfg(DEBUG, "--parallelism.pp=3", "--pipeline.microbatches=4")
    with pytest.raises(ConfigError, match="do not split evenly"):
        run_isolated(estimate, cfg, 3)


# --------------------------------------------------------------------------- tensor parallel


def _engram_forward(model, ids, hash_ids) -> dict:
    """One forward: bytes autograd saves inside the (one) Engram block, ids its table looks up."""
    (block,) = model.engram_blocks().values()
    held = {
        (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
        for p in [*model.parameters(), *model.buffers()]
    }
    inside, saved, looked_up = [False], {}, []
    block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    block.table.register_forward_pre_hook(lambda _m, args: looked_up.append(args[0].numel()))

    def pack(x):
        if inside[0]:
            saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(ids, hash_ids=hash_ids)
    return {"saved": sum(n for ptr, n in saved.items() if ptr not in held), "ids": sum(looked_up)}


def _engram_on_tp_ranks(rank: int, world: int, cfgs: list) -> list[dict]:
    """Per config, on a real TP rank (gloo): the bytes autograd saves inside the Engram block
    during one forward, and the ids its table looks up."""
    from engram.data.tokenizer import load_tokenizer
    from engram.hashing.ngram import NgramHasher
    from engram.models.builder import build_model_from_config
    from parallelisms.parallel_dims import parallel_dims_from_config
    from parallelisms.parallelize import parallelize_model

    out = []
    for cfg in cfgs:
        dims = parallel_dims_from_config(cfg, world)
        dims.build_mesh("cpu")
        tok = load_tokenizer(cfg.model.tokenizer_path)
        model = build_model_from_config(cfg, tok.vocab_size)
        parallelize_model(model, cfg, dims)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        hasher = NgramHasher.from_config(cfg.engram, tok, tok.vocab_size)
        t = cfg.training
        gen = torch.Generator().manual_seed(0)  # the same batch on every rank of the TP group
        ids = torch.randint(0, tok.vocab_size, (t.local_batch_size, t.seq_len), generator=gen)
        hash_ids = torch.from_numpy(hasher(ids.numpy()))
        out.append(_engram_forward(model, ids, hash_ids))
    return out


@pytest.mark.slow
def test_engram_is_sequence_sharded_with_and_without_sequence_parallel():
    """Under TP the Engram block runs on and looks up only its rank's tokens whether or not
    tp_sequence_parallel is on (parallelisms/tensor_parallel.py). On 2 real gloo TP ranks: the
    table looks up tokens / axis_divisors(...).engram_tokens ids per rank (what the planner's
    all-to-all counts), the block saves the same bytes in both modes, and so does the planner,
    within 15% of the measurement (TP adds tensors the formula does not count, such as the
    ShortConv's halo: 11% here)."""
    from parallelisms.parallel_dims import axis_divisors

    base = ["--training.local_batch_size=2", "--training.seq_len=32", "--job.device=cpu"]
    cfgs = [
        _cfg("train_configs/debug_tp.toml", *base, f"--parallelism.tp_sequence_parallel={sp}")
        for sp in ("true", "false")
    ]
    results = run_distributed(_engram_on_tp_ranks, 2, cfgs)
    args = get_model_args("llama3", "debug").replace(vocab_size=4096)
    predicted, measured = [], []
    for k, cfg in enumerate(cfgs):
        sp = cfg.parallelism.tp_sequence_parallel
        est = activation_estimate(cfg, args, "float32", tp=2, sp=sp)
        predicted.append(est.per_engram_layer_extra_bytes)
        tokens = cfg.training.local_batch_size * cfg.training.seq_len
        heads = (cfg.engram.max_ngram - 1) * cfg.engram.n_head_per_ngram
        for rank in results:
            got = rank[k]
            assert got["ids"] == tokens * heads // axis_divisors(2, sp).engram_tokens, (sp, got)
            assert abs(predicted[k] - got["saved"]) / got["saved"] < 0.15, (sp, predicted, got)
            measured.append(got["saved"])
    assert predicted[0] == predicted[1]
    assert max(measured) / min(measured) < 1.01, measured


# --------------------------------------------------------------------------- refusals


def test_every_step_and_setting_is_registered():
    """A new parallelize_model step or config setting must be classified in planner/registry.py
    (modelled, and where; or without memory effect) before the planner runs."""
    from engram.config import JobConfig
    from planner import registry

    names = set(registry.settings(JobConfig()))
    unlisted = names - set(registry.MODELLED) - registry.NO_MEMORY_EFFECT
    assert not unlisted, f"classify in planner/registry.py: {sorted(unlisted)}"
    listed = set(registry.MODELLED) | registry.NO_MEMORY_EFFECT | set(registry.MODELLED_VALUES)
    assert listed <= names, f"stale names in planner/registry.py: {sorted(listed - names)}"
    assert not set(registry.MODELLED) & registry.NO_MEMORY_EFFECT
    unmodelled = set(registry.parallelize_steps()) - set(registry.STEPS)
    assert not unmodelled, f"model and register in planner/registry.py STEPS: {unmodelled}"


def test_unmodelled_step_or_setting_is_refused_by_name(monkeypatch):
    """A parallelize_model step the planner does not model, a memory-changing setting it does
    not list, or a listed setting at a value it does not model: refused, naming it."""
    from parallelisms import parallelize
    from planner import registry

    cfg = _cfg(DEBUG)
    with monkeypatch.context() as m:
        m.setattr(parallelize, "apply_new_parallelism", lambda *_: None, raising=False)
        with pytest.raises(ConfigError, match="step.* apply_new_parallelism"):
            estimate(cfg, 2)
    with monkeypatch.context() as m:
        m.delitem(registry.MODELLED, "parallelism.cpu_offload")
        registry.check_modelled(cfg)  # at its default it changes nothing: accepted
        with pytest.raises(ConfigError, match="parallelism.cpu_offload = True"):
            estimate(_cfg(DEBUG, "--parallelism.cpu_offload=true"), 2)
    with pytest.raises(ConfigError, match="parallelism.tp_loss_parallel = False"):
        estimate(_cfg(DEBUG, "--parallelism.tp_loss_parallel=false"), 2)


# --------------------------------------------------------------------------- --compare


def test_layout_names():
    a, b = parse_layout("PP2xTP4xFSDP8"), parse_layout("pp2xtp4xfsdp8")
    assert (a.pp, a.tp, a.dp_shard) == (b.pp, b.tp, b.dp_shard) == (2, 4, 8)
    layout = parse_layout("PP2xTP4xHSDP2x4")
    assert (layout.pp, layout.tp, layout.dp_replicate, layout.dp_shard) == (2, 4, 2, 4)
    assert layout.world == 64
    with pytest.raises(ConfigError, match="use terms FSDP<n>"):
        parse_layout("ZeRO3x64")
    assert default_layouts(64, 8)[:4] == ["FSDP64", "HSDP8x8", "TP4xFSDP16", "TP8xFSDP8"]
    assert {"PP4xFSDP16", "PP2xTP4xFSDP8"} <= set(default_layouts(64, 8))


def test_layouts_keep_the_global_batch():
    cfg = _cfg(NPU_32B)
    t = cfg.training
    global_seqs = t.local_batch_size * t.grad_accum_steps * 64
    for name in default_layouts(64, 8):
        layout = parse_layout(name)
        lt = layout_config(cfg, layout, 64).training
        dp = layout.dp_replicate * layout.dp_shard
        assert lt.local_batch_size * lt.grad_accum_steps * dp == global_seqs, name


def test_compare_on_the_32b_config_at_64_ranks(capfd):
    """Every default candidate layout of the 32B NPU config at 64 ranks gets a row (peak,
    communication, fit verdict) and the planner picks the layout the config ships."""
    rows = run_isolated(
        main, ["--job.config_file", NPU_32B, "--world_size", "64", "--compare"], timeout=600
    )
    out = capfd.readouterr().out
    names = default_layouts(64, 8)
    assert [r.layout for r in rows] == names
    assert all(r.estimate is not None for r in rows)
    by_name = {r.layout: r for r in rows}
    assert not by_name["HSDP8x8"].estimate.fits  # 8-way sharding of 32B + Adam: > 61 GiB
    assert by_name["FSDP64"].estimate.fits
    for r in rows:
        worst = max(r.estimate.ranks, key=lambda m: m.peak_bytes)
        assert f"| {r.layout} |" in out
        assert (worst.comm.pp_send_recv > 0) == (r.estimate.pp > 1)
        assert (worst.comm.tp > 0) == (r.estimate.tp > 1)
    cfg = _cfg(NPU_32B)
    shipped = (
        f"FSDP{64 // (cfg.parallelism.tp * cfg.parallelism.pp)}"
        if cfg.parallelism.pp == 1 and cfg.parallelism.tp == 1
        else None
    )
    assert "Planner's pick (fits with >= 15% of device memory free, no TP on npu" in out
    assert f"**{shipped}**" in out


def test_long_context_config_needs_tensor_parallelism():
    """32b_gpu_32k.toml (TP 4 x FSDP 16, seq_len 32768) fits in 80 GB (79.11 GiB usable); the same model and
    sequence on FSDP-64 does not (the fp32 loss of one 32768-token sequence alone is 55.7 GiB)."""
    path = "train_configs/32b_gpu_32k.toml"
    cfg = _cfg(path)
    assert cfg.training.seq_len == 32768 and cfg.parallelism.tp == 4
    est = planned(path, world=64, ranks=[0])
    assert est.fits and est.device_memory_bytes == int(79.11 * 2**30)  # usable, not 80
    fsdp = ("--parallelism.tp=1", "--training.local_batch_size=1", "--training.grad_accum_steps=1")
    no_tp = planned(path, *fsdp, world=64, ranks=[0])
    assert not no_tp.fits
    assert no_tp.ranks[0].activations.loss_bytes > 55 * 2**30
