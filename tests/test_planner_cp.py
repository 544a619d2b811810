"""The memory planner under context parallelism (parallelism.cp): activations per
method against the bytes autograd really saves on 2 gloo cp ranks, the cp collectives' bytes
against a count by hand, FSDP over dp_shard x cp against real ranks, --compare's CP
candidates, the refusal of what cp does not compose with, and the shipped long-context NPU
configs against the usable memory of an Atlas A2 / A3 with 10% to spare."""

from __future__ import annotations

import pytest
import torch
from launcher import run_distributed, run_isolated
from planner_runs import planned
from saved_bytes import saved_activation_bytes
from small_job import load_shipped
from test_planner_estimate import _real_rank_counts

from engram.models.args import get_model_args
from engram.runtime.device_specs import usable_memory_gib
from planner.activations import activation_estimate
from planner.compare import compare
from planner.estimate import estimate
from planner.layouts import cp_layouts, layout_config, parse_layout, spans_nodes

DEBUG = "train_configs/debug_model.toml"
GIB = 2**30


def _cfg(path: str, *overrides: str):
    return load_shipped(path, *overrides)


@pytest.mark.parametrize("method", ["ulysses", "allgather_kv"])
def test_activations_at_cp2_are_about_half_of_cp1(method):
    """Same layout and micro-batch: a cp rank holds 1 / cp of the tokens. Ulysses halves every
    term but keeps the attention output twice (head- and token-sharded): a little over half;
    all-gather K/V keeps the whole sequence's K and V in the kernel, so without checkpointing
    it saves more than half; the loss halves in both."""
    cfg = _cfg(DEBUG, "--training.seq_len=256")
    args = get_model_args("llama3", "debug")
    args.vocab_size = 1000
    one = activation_estimate(cfg, args, "bfloat16")
    two = activation_estimate(cfg, args, "bfloat16", cp=2, cp_method=method)
    four = activation_estimate(cfg, args, "bfloat16", cp=4, cp_method=method)
    assert two.tokens == one.tokens  # tokens count whole sequences; the rank holds 1 / cp
    assert abs(two.loss_bytes * 2 - one.loss_bytes) <= 2
    ratio = two.saved_bytes / one.saved_bytes
    if method == "ulysses":
        assert 0.5 < ratio < 0.53, ratio
        assert 0.25 < four.saved_bytes / one.saved_bytes < 0.28
    else:
        assert 0.5 < ratio < 0.75, ratio
        assert four.saved_bytes < two.saved_bytes
    # Full activation checkpointing keeps only layer inputs: 1 / cp for both methods.
    ac = _cfg(DEBUG, "--training.seq_len=256", "--activation_checkpoint.mode=full")
    one = activation_estimate(ac, args, "bfloat16")
    two = activation_estimate(ac, args, "bfloat16", cp=2, cp_method=method)
    assert 0.49 < two.saved_bytes / one.saved_bytes < 0.51


def _saved_bytes_on_cp_ranks(rank: int, world: int, cfg, seq: int) -> dict[str, int]:
    """Bytes autograd saves for backward on this cp rank, per method (fp32, debug model with
    Engram at layer 1): the plain model with only apply_context_parallel, its part of the batch."""
    from engram.data.tokenizer import load_tokenizer
    from engram.hashing.ngram import NgramHasher
    from engram.models.builder import build_model
    from parallelisms.context_parallel import apply_context_parallel, split_batch
    from parallelisms.parallel_dims import ParallelDims

    tok = load_tokenizer("")
    hasher = NgramHasher.from_config(cfg.engram, tok, tok.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tok.vocab_size, (2, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids, "hash_ids": torch.from_numpy(hasher(ids.numpy()))}
    out = {}
    for method in ("ulysses", "allgather_kv"):
        dims = ParallelDims(1, 1, 1, 1, world, cp=world, cp_method=method)
        dims.build_mesh("cpu")
        torch.manual_seed(0)
        model = build_model(cfg.model, cfg.engram, tok.vocab_size, hasher.table_rows, "cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        apply_context_parallel(model, dims)
        part = split_batch(batch, dims)
        out[method] = saved_activation_bytes(
            model, part["input_ids"], hash_ids=part["hash_ids"], positions=part["positions"]
        )
    return out


def test_cp_activation_formula_matches_what_autograd_saves():
    """On 2 real gloo cp ranks, per method, the planner's saved activations (all-gather K/V's
    additive masks included) are within 3% of the bytes autograd saves on each rank."""
    seq = 128  # all-gather K/V at cp 2: 4 pieces of 32 >= the ShortConv reach of 9
    cfg = _cfg(DEBUG, "--training.local_batch_size=2", f"--training.seq_len={seq}")
    measured = run_distributed(_saved_bytes_on_cp_ranks, 2, cfg, seq)
    args = get_model_args("llama3", "debug")
    args.vocab_size = 1000  # the loss is not part of the saved layer activations compared here
    for method in ("ulysses", "allgather_kv"):
        act = activation_estimate(cfg, args, "float32", cp=2, cp_method=method)
        predicted = act.saved_bytes
        for rank in measured:
            got = rank[method]
            assert abs(predicted - got) / got < 0.03, (method, predicted, got)


def test_cp_bytes_per_step_by_hand():
    """planner/comm.py's CP line against a count written out from the shapes: debug llama3
    (dim 256, 4 heads x 64, 2 KV heads, 4 layers, Engram at layer 1, kernel 4, max_ngram 3),
    2 sequences of 128 tokens in one micro-batch, in the compute dtype (FSDP runs over the 2 cp
    ranks, so the config's mixed_precision_param)."""
    cfg = _cfg(
        DEBUG,
        "--parallelism.cp=2",
        "--parallelism.dp_shard=1",
        "--training.local_batch_size=2",
        "--training.grad_accum_steps=1",
    )
    a = 2 if cfg.parallelism.mixed_precision_param == "bfloat16" else 4
    local = 2 * 128 // 2  # tokens per cp rank
    dq, dkv = 4 * 64, 2 * 64
    for method, attention in (
        # Ulysses: q, k, v and the output all-to-all'd, half of each stays local.
        ("ulysses", local * (2 * dq + 2 * dkv) * a // 2),
        # all-gather K/V: the other rank's K and V.
        ("allgather_kv", local * 2 * dkv * a),
    ):
        c = _cfg(
            DEBUG,
            "--parallelism.cp=2",
            "--parallelism.dp_shard=1",
            f"--parallelism.cp_method={method}",
            "--training.local_batch_size=2",
            "--training.grad_accum_steps=1",
        )
        est = run_isolated(estimate, c, 2, ranks=[0])
        pieces = 2 if method == "allgather_kv" else 1
        halo = pieces * 2 * (3 * 3) * 256 * a  # 2 sequences x 9 positions x dim, 1 other rank
        # 4 layers, forward + backward, no recompute; layer 1 carries the Engram block's halo.
        assert est.ranks[0].comm.cp == 2 * (4 * attention + halo), method
        assert est.cp == 2 and est.cp_method == method


def test_cp_fsdp_and_table_shards_match_real_ranks():
    """CP 2 x FSDP 2 at world 4: the fake process group builds the cp mesh and the planner's
    per-rank parameters (FSDP over dp_shard x cp = 4) and table rows (over dp x cp = 4) equal
    what 4 real gloo ranks hold; the FSDP buffers pad to the 4-rank shard group."""
    cfg = _cfg(DEBUG, "--parallelism.cp=2", "--parallelism.dp_shard=2")
    est = run_isolated(estimate, cfg, 4, ranks=[0, 1, 2, 3])
    real = run_distributed(_real_rank_counts, 4, cfg)
    for mem, (dense, rows) in zip(est.ranks, real, strict=True):
        assert mem.dense_params == dense, mem.rank
        assert dict(mem.table_rows) == rows, mem.rank
    assert est.all_ranks.dense_params_sum == est.global_dense_params  # 1 replica, 4 shards
    fsdp64 = run_isolated(estimate, _cfg(DEBUG), 4, ranks=[0])  # FSDP 4 without CP
    assert est.ranks[0].dense_params == fsdp64.ranks[0].dense_params
    assert est.ranks[0].fsdp.layer_gather_bytes == fsdp64.ranks[0].fsdp.layer_gather_bytes
    assert est.ranks[0].comm.cp > 0 and fsdp64.ranks[0].comm.cp == 0


def test_compare_lists_cp_candidates():
    """--cp adds CP x FSDP (and CP x TP x FSDP inside a node) candidates; --cp_methods gives a
    row per method, each estimated at the same global batch with its cp collectives."""
    assert parse_layout("CP8xFSDP8").world == 64 and parse_layout("cp4xfsdp16").cp == 4
    assert cp_layouts(64, 8, [4, 8]) == [
        "CP4xFSDP16",
        "CP4xTP2xFSDP8",
        "CP8xFSDP8",
    ]
    # cp is inside tp's stride: CP 8 stays in a node, its FSDP group (dp_shard x cp) does not.
    spans = spans_nodes(parse_layout("CP8xFSDP8"), 8)
    assert not spans["cp"] and spans["fsdp_all_gather"]
    cfg = _cfg(DEBUG, "--training.local_batch_size=2", "--training.grad_accum_steps=2")
    lcfg = layout_config(cfg, parse_layout("CP2xFSDP2"), 4)
    assert lcfg.parallelism.cp == 2 and lcfg.training.grad_accum_steps == 4  # 16 seqs, dp 2
    rows = run_isolated(
        compare,
        cfg,
        4,
        layouts=["FSDP4", "CP2xFSDP2"],
        cps=None,
        cp_methods=["ulysses", "allgather_kv"],
    )
    assert [(r.layout, r.micro.split(", ")[-1]) for r in rows] == [
        ("FSDP4", "2 x 2 seq"),
        ("CP2xFSDP2", "ulysses"),
        ("CP2xFSDP2", "allgather_kv"),
    ]
    for r in rows:
        assert r.estimate is not None, r.error
        worst = r.estimate.ranks[0]
        assert (worst.comm.cp > 0) == ("CP" in r.layout)
    # A CP layout the model cannot take is an invalid row naming the fix, not a crash.
    bad = run_isolated(compare, cfg, 4, layouts=["CP4xFSDP1"], cp_methods=["ulysses"])
    assert bad[0].estimate is None and "allgather_kv" in bad[0].error


def test_hc_mult_is_refused_for_what_it_is_at_cp():
    """engram.hc_mult > 1 at cp 2 is refused by the recipe's own reason (a dense model has one
    residual stream, engram/models/builder.py), not by a CP-specific one."""
    cfg = _cfg(DEBUG, "--parallelism.cp=2", "--engram.hc_mult=2")
    with pytest.raises(ValueError, match=r"engram.hc_mult = 2, but these dense models have a"):
        run_isolated(estimate, cfg, 4)


def test_cp_composes_with_pipeline_and_host_tables():
    """CP 2 x PP 2: each stage's activations are those of its layers at cp 2 (about half of
    cp 1's); host tables under CP look up each rank's T / cp tokens (half the rows on device)."""
    common = ("--parallelism.pp=2", "--training.local_batch_size=4", "--pipeline.microbatches=2")
    pp = run_isolated(estimate, _cfg(DEBUG, *common), 4, ranks=[0])
    cp = run_isolated(estimate, _cfg(DEBUG, *common, "--parallelism.cp=2"), 4, ranks=[0])
    for one, two in zip(pp.stage_activations, cp.stage_activations, strict=True):
        assert 0.5 < two.saved_bytes / one.saved_bytes < 0.53
    assert cp.ranks[0].comm.cp > 0 and cp.ranks[0].comm.pp_send_recv * 2 == (
        pp.ranks[0].comm.pp_send_recv
    )
    host = ("--engram.table_location=host", "--optimizer.table_optimizer=lazy_adam")
    h1 = run_isolated(estimate, _cfg(DEBUG, *host), 4, ranks=[0])
    h2 = run_isolated(estimate, _cfg(DEBUG, *host, "--parallelism.cp=2"), 4, ranks=[0])
    assert h2.ranks[0].host_table_device_bytes * 2 == h1.ranks[0].host_table_device_bytes


@pytest.mark.parametrize(
    "path", ["train_configs/32b_npu_32k.toml", "train_configs/32b_npu_128k.toml"]
)
def test_long_context_npu_configs_fit_usable_memory_with_10_percent_free(path):
    """The shipped CP configs, planned against the usable memory of a 64 GB Atlas A2 / A3
    (engram/runtime/device_specs.py: 60.96 GiB), keep at least 10% of it free, without TP or
    CPU offload."""
    cfg = _cfg(path)
    p = cfg.parallelism
    assert p.cp > 1 and p.tp == 1 and p.pp == 1 and not p.cpu_offload
    budget = usable_memory_gib("npu")
    # the default budget of an npu config (shares the plan with test_train_chunked_loss)
    est = planned(path, world=64, ranks=[0])
    assert est.device_memory_bytes == int(budget * GIB)
    peak = est.ranks[0].peak_bytes
    assert peak <= 0.9 * budget * GIB, peak / GIB
