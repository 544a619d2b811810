"""Context parallelism (parallelism.cp, parallelisms/context_parallel.py).

- The model under cp (attention by Ulysses or all-gather K/V, the Engram ShortConv halo, RoPE at
  global positions, the step's target-token count over the cp group) equals one rank: logits, loss and every
  parameter gradient, at cp 2 and 4, with labels ignored unevenly across the chunks.
- Through the real recipe: every cp layout reproduces the single-process run
  (tests/test_parallelisms_parity.py's criteria), Engram at layer 0 (halo and n-grams cross the
  chunk boundaries) and layer 2.
- Degrees that do not fit are refused naming the values; what does not compose yet is refused.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from launcher import run_distributed
from shared_runs import shared_run

from engram.config import ConfigError, Engram, config_from_dict
from engram.models.args import ModelArgs, get_model_args
from parallelisms.parallel_dims import ParallelDims

# A model with 8 query / 4 KV heads (Ulysses at cp 4 needs 4 | KV heads), Engram at layer 0.
ARGS = ModelArgs(
    dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=97, max_seq_len=256
)
ENGRAM = Engram(
    layer_ids=[0],
    n_head_per_ngram=2,
    vocab_size_per_ngram=[101, 103],
    n_embed_per_ngram=16,
    init="paper",
)
ROWS = 500
SEQ = 128  # all-gather K/V at cp 4: 8 pieces of 16 >= the ShortConv reach of 9


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ARGS.vocab_size, (2, SEQ), generator=g)
    labels = torch.randint(0, ARGS.vocab_size, (2, SEQ), generator=g)
    labels[0, 5:40] = -100  # ignored tokens unevenly spread over the chunks
    labels[1, 100:103] = -100
    hash_ids = torch.randint(0, ROWS, (2, SEQ, 1, ENGRAM.num_heads), generator=g)
    return {"input_ids": ids, "labels": labels, "hash_ids": hash_ids}


def _model_parity(rank: int, world: int) -> list[str]:
    """For each layout: max relative error of logits, loss and gradients against one rank."""
    import torch.distributed as dist

    from engram.models.transformer import Transformer
    from engram.train.loss import LanguageModelLoss, TargetTokens, summed_cross_entropy
    from parallelisms.context_parallel import apply_context_parallel, split_batch

    report = []
    for cp, method in ((4, "ulysses"), (4, "allgather_kv"), (2, "ulysses"), (2, "allgather_kv")):
        dims = ParallelDims(1, world // cp, 1, 1, world, cp=cp, cp_method=method)
        dims.check_model(ARGS, SEQ, engram_halo=(ENGRAM.kernel_size - 1) * ENGRAM.max_ngram)
        dims.build_mesh("cpu")
        torch.manual_seed(0)
        ref = Transformer(ARGS, ENGRAM, {0: ROWS})
        ref.init_weights(seed=0)
        model = copy.deepcopy(ref)
        batch = _batch()
        ref_logits = ref(batch["input_ids"], hash_ids=batch["hash_ids"])
        labels = batch["labels"]
        ref_loss = summed_cross_entropy(ref_logits, labels) / (labels != -100).sum()
        ref_loss.backward()

        apply_context_parallel(model, dims)
        part = split_batch(batch, dims)
        cp_group = dims.mesh("cp").get_group()
        tokens = TargetTokens.count([part["labels"]], cp_group)  # the step's count over cp
        logits = model(part["input_ids"], hash_ids=part["hash_ids"], positions=part["positions"])
        loss = LanguageModelLoss(1, None, False)(logits, part["labels"], tokens.divisor)
        loss.backward()
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss, group=cp_group)  # the shares add up to the token mean
        errs = {
            "logits": _rel(logits, ref_logits[:, part["positions"][0]]),
            "loss": _rel(total_loss, ref_loss),
            "count": float(tokens.total != (labels != -100).sum()),
        }
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            g = p.grad.clone()
            dist.all_reduce(g, group=cp_group)  # FSDP's sum over cp
            errs[name] = _rel(g, q.grad)
        worst = max(errs, key=errs.get)
        report.append((f"cp{cp}-{method}", worst, errs[worst]))
    return report


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


@pytest.mark.slow
def test_model_under_cp_equals_one_rank():
    """Measured: logits, loss and every gradient within 4.2e-7 relative (worst: a wv gradient);
    with the halo zeroed (a deliberate break) gradients differ by 0.5 to 1.1."""
    for rank_report in run_distributed(_model_parity, 4):
        for layout, worst, err in rank_report:
            assert err < 1e-5, f"{layout}: {worst} differs by {err:.1e} (relative)"


# ----------------------------------------------------------------------------- refusals


def _debug_args() -> ModelArgs:
    return dataclasses.replace(get_model_args("llama3", "debug"), vocab_size=2048)


def _dims(cp: int, method: str, tp: int = 1) -> ParallelDims:
    return ParallelDims(1, 1, tp, 1, cp * tp, cp=cp, cp_method=method)


def test_ulysses_with_indivisible_heads_points_at_allgather_kv():
    args = _debug_args()  # 4 query heads, 2 KV heads
    with pytest.raises(
        ConfigError, match=r"n_kv_heads=2 is not divisible by tp x cp = 1 x 4.*allgather_kv"
    ):
        _dims(4, "ulysses").check_model(args, 128)
    with pytest.raises(ConfigError, match=r"n_kv_heads=2 is not divisible by tp x cp = 2 x 2"):
        _dims(2, "ulysses", tp=2).check_model(args, 128)
    _dims(4, "allgather_kv").check_model(args, 128)  # any head count


def test_seq_len_not_divisible_names_the_values():
    args = _debug_args()
    with pytest.raises(
        ConfigError,
        match=r"seq_len=102 is not divisible by cp\(2\) x tp\(1\) x 2 \(load-balanced chunks\) = 4",
    ):
        _dims(2, "allgather_kv").check_model(args, 102)
    with pytest.raises(ConfigError, match=r"seq_len=99 is not divisible by cp\(2\) x tp\(1\) = 2"):
        _dims(2, "ulysses").check_model(args, 99)


def test_piece_shorter_than_the_shortconv_halo_names_the_values():
    args = _debug_args()
    with pytest.raises(
        ConfigError, match=r"seq_len=32 in 8 pieces .* 4 tokens per piece, fewer than .* reach of 9"
    ):
        _dims(4, "allgather_kv").check_model(args, 32, engram_halo=9)
    _dims(4, "allgather_kv").check_model(args, 72, engram_halo=9)  # 9 per piece: enough


def test_world_size_product_names_cp():
    with pytest.raises(ConfigError, match=r"x cp\(2\) x tp\(1\) = 6, but 4 processes"):
        ParallelDims(1, 3, 1, 1, 4, cp=2)
    assert ParallelDims(1, -1, 1, 1, 8, cp=2).dp_shard == 4


def test_cp_config_checks():
    with pytest.raises(ConfigError, match="cp_method must be one of ulysses, allgather_kv"):
        config_from_dict({"parallelism": {"cp_method": "ring"}})
    with pytest.raises(ConfigError, match="parallelism.cp must be >= 1"):
        config_from_dict({"parallelism": {"cp": 0}})


# ----------------------------------------------------------------------------- through the recipe

# Engram at layer 0 (its ShortConv halo and n-grams cross every chunk boundary) and layer 2, paper
# init, seq_len 128 (all-gather K/V at cp 4: pieces of 16 >= the reach of 9).
ENGRAM_0_2 = {"engram": {"layer_ids": [0, 2]}}
NO_ENGRAM = {"engram": {"enabled": False}}

# label -> (world, parallelism section, Engram, steps, extra sections)
# Ulysses runs the unchanged causal kernel on the whole sequence of its heads: within
# test_parallelisms_parity's bounds over 5 steps in this setting (measured at step 5: cp 2 losses
# 2.2e-7, grad norms 1.2e-4; FSDP 2 x cp 2 grad norms 7e-5; cp 2 x pp 2 7e-6; other settings
# drift otherwise, docs/parallelisms.md); compared over 3 steps here (the reference is the one
# test_cp_composes_with_host_tables_compile_and_lora's compiled run shares). All-gather K/V runs
# a masked kernel over gathered keys (another fp32 summation order): step 1 matches to 1e-6, then
# the Engram gate amplifies the order as under TP (tests/test_parallelisms_tp.py; measured at
# cp 2, step 5: grad norm 4.3e-3; with identity init a gate weight's update 9.8e-3 relative), so
# with Engram it is compared over 2 steps like TP, and over 3 steps without Engram (measured at
# cp 2 over 5 steps: losses and grad norms 8e-8). 4 ranks only where the layout needs them.
ULYSSES_STEPS = 3
CP_LAYOUTS = {
    "cp2_ulysses": (2, {"cp": 2, "cp_method": "ulysses"}, ENGRAM_0_2, ULYSSES_STEPS, {}),
    "fsdp2_x_cp2_ulysses": (4, {"cp": 2, "dp_shard": 2}, ENGRAM_0_2, ULYSSES_STEPS, {}),
    # HSDP: 2 replicas, each sharded over dp_shard x cp = 2 ranks of one sample's chunks
    "hsdp2x1_x_cp2_ulysses": (4, {"cp": 2, "dp_replicate": 2}, ENGRAM_0_2, ULYSSES_STEPS, {}),
    "cp2_ulysses_ac_chunked_loss": (
        2, {"cp": 2}, ENGRAM_0_2, ULYSSES_STEPS,
        {"activation_checkpoint": {"mode": "full"}, "training": {"loss_chunks": 2}},
    ),
    "cp2_x_pp2_ulysses": (4, {"cp": 2, "pp": 2}, ENGRAM_0_2, ULYSSES_STEPS, {}),
    "cp2_allgather_kv": (2, {"cp": 2, "cp_method": "allgather_kv"}, ENGRAM_0_2, 2, {}),
    "cp4_allgather_kv": (4, {"cp": 4, "cp_method": "allgather_kv"}, ENGRAM_0_2, 2, {}),
    "cp2_x_tp2_allgather_kv": (
        4, {"cp": 2, "tp": 2, "cp_method": "allgather_kv"}, ENGRAM_0_2, 2, {},
    ),
    "cp2_allgather_kv_no_engram": (
        2, {"cp": 2, "cp_method": "allgather_kv"}, NO_ENGRAM, ULYSSES_STEPS, {},
    ),
}  # fmt: skip


def _recipe_raw(folder: str, world: int, layout: dict, engram: dict, steps: int) -> dict:
    from test_parallelisms_parity import GLOBAL_BATCH, _config, _with

    layout = {"dp_shard": 1, **layout}
    raw = _with(_config(folder, world, "full", layout), engram)
    dp = world // (layout.get("cp", 1) * layout.get("tp", 1) * layout.get("pp", 1))
    raw["training"].update(seq_len=128, steps=steps, local_batch_size=GLOBAL_BATCH // dp)
    return raw


@pytest.mark.slow
def test_cp_layouts_match_single_process(tmp_path):
    import numpy as np
    from test_parallelisms_parity import _assert_matches, _initial_weights, _train, _with

    refs: dict[str, tuple[dict, dict]] = {}
    for label, (world, layout, engram, steps, extra) in CP_LAYOUTS.items():
        key = f"{engram['engram'].get('enabled', True)}-{steps}"
        if key not in refs:
            raw = _recipe_raw(str(tmp_path / f"ref-{key}"), 1, {}, engram, steps)
            refs[key] = (shared_run(_train, 1, raw)[0], _initial_weights(raw))
        ref, init = refs[key]
        raw = _with(_recipe_raw(str(tmp_path / label), world, layout, engram, steps), extra)
        results = run_distributed(_train, world, raw)
        # Under PP a rank holds its stage's weights: compare the union over the ranks.
        weights = {n: w for got in results for n, w in got["weights"].items()}
        for rank, got in enumerate(results):
            assert all(np.array_equal(w, weights[n]) for n, w in got["weights"].items()), rank
            got = {**got, "weights": weights}
            _assert_matches(got, ref, init, f"{label} (world {world}, rank {rank})")


@pytest.mark.slow
def test_ulysses_cp4_and_cp2_x_tp2_step_1(tmp_path):
    """Ulysses at cp 4 and at cp 2 x tp 2 needs 4 | KV heads: the llama3 "mid" flavor (8 / 4),
    step 1 only (it is 4x the debug model). Measured: loss 6e-8, grad norm 7e-8 (cp 4) and
    1.2e-6 (cp 2 x tp 2: TP's summation order through the Engram gate, as in
    tests/test_parallelisms_tp.py). 5 steps measured: grad norms within 2.5e-5 / 1.5e-4."""
    from test_parallelisms_parity import _train

    mid = {**ENGRAM_0_2, "model": {"flavor": "mid"}}
    (ref,) = shared_run(_train, 1, _recipe_raw(str(tmp_path / "ref"), 1, {}, mid, 1))
    for label, layout in (("cp4", {"cp": 4}), ("cp2_x_tp2", {"cp": 2, "tp": 2})):
        raw = _recipe_raw(str(tmp_path / label), 4, layout, mid, 1)
        for rank, got in enumerate(run_distributed(_train, 4, raw)):
            where = f"{label} ulysses (rank {rank})"
            assert got["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-5, abs=0), where
            assert got["grad_norms"][0] == pytest.approx(ref["grad_norms"][0], rel=1e-5, abs=0), (
                where
            )


# ----------------------------------------------------------------------------- checkpoints

# (world, parallelism section, last step): cp 2 -> 1 -> 2, both methods; one step per leg (each
# leg saves at its last step, the next loads it and trains a step on it)
RESUME_LEGS = [
    (1, {}, 1),
    (2, {"cp": 2, "cp_method": "ulysses"}, 2),
    (1, {}, 3),
    (4, {"cp": 2, "dp_shard": 2, "cp_method": "allgather_kv"}, 4),
]


def _resume_raw(folder: str, world: int, layout: dict, steps: int) -> dict:
    from test_checkpoint_reshard import GLOBAL_BATCH, _raw

    raw = _raw(folder, world, 1, 1, 1, 1, steps)
    raw["parallelism"] = {"dp_shard": 1, "pp": 1, **layout}
    raw["training"].update(
        seq_len=64, local_batch_size=GLOBAL_BATCH // raw["parallelism"]["dp_shard"]
    )
    return raw


@pytest.mark.slow
def test_resume_across_cp_degrees(tmp_path):
    """DCP reshard at another cp degree (tests/test_checkpoint_reshard.py's criteria): right after
    each load, the full model, both optimizers' states (incl. the row-sharded tables' lazy Adam)
    and the loader position equal bit for bit what the previous leg saved; the losses replay the
    uninterrupted one-process run to 1e-5."""
    import numpy as np
    from test_checkpoint_reshard import _leg, _merged

    end = RESUME_LEGS[-1][-1]
    (ref,) = run_distributed(_leg, 1, _resume_raw(str(tmp_path / "ref"), 1, {}, end))
    prev_final, prev_end = None, 0
    for world, layout, last in RESUME_LEGS:
        out = run_distributed(
            _leg, world, _resume_raw(str(tmp_path / "chain"), world, layout, last)
        )
        assert out[0]["start"] == prev_end, (layout, out[0]["start"])
        if prev_final is not None:
            loaded = _merged(out, "loaded")
            assert loaded.keys() == prev_final.keys()
            for key, value in prev_final.items():
                assert np.array_equal(loaded[key], value), f"{layout}: {key} changed"
        np.testing.assert_allclose(
            out[0]["losses"], ref["losses"][prev_end:last], rtol=1e-5, err_msg=str(layout)
        )
        prev_final, prev_end = _merged(out, "final"), last


def test_debug_cp_config_fits_the_model():
    """train_configs/debug_cp.toml's degrees pass the model checks at 2 and 4 processes, with
    both methods (measured through run_train.sh at NGPU=2: steps 1-3 losses and grad norms as
    printed equal to the same config at cp 1, eval loss too)."""
    from pathlib import Path

    from engram.config import load_config
    from engram.hashing.ngram import engram_table_rows
    from engram.models.builder import build_model
    from parallelisms.parallel_dims import parallel_dims_from_config
    from parallelisms.parallelize import engram_halo

    path = Path(__file__).resolve().parents[1] / "train_configs" / "debug_cp.toml"
    for method in ("ulysses", "allgather_kv"):
        cfg = load_config([f"--job.config_file={path}", f"--parallelism.cp_method={method}"])
        model = build_model(cfg.model, cfg.engram, 2048, engram_table_rows(cfg.engram), "meta")
        for world in (2, 4):
            dims = parallel_dims_from_config(cfg, world)
            assert dims.cp == 2 and dims.dp_size == world // 2 and dims.fsdp_size == world
            dims.check_model(model.args, cfg.training.seq_len, engram_halo(cfg))


def test_hc_mult_has_one_refusal_at_every_cp():
    """engram.hc_mult > 1 is refused for every dense model by the model builder (one residual
    stream), at cp 1 and 2 alike: no CP-specific refusal describes a case that cannot occur."""
    from engram.config import JobConfig
    from engram.hashing.ngram import engram_table_rows
    from engram.models.builder import build_model

    cfg = JobConfig()
    cfg.engram.hc_mult = 2
    with pytest.raises(
        ValueError, match=r"engram.hc_mult = 2, but these dense models have a single"
    ):
        build_model(cfg.model, cfg.engram, 2048, engram_table_rows(cfg.engram), "meta")
    import parallelisms.context_parallel as cp_module

    assert not hasattr(cp_module, "check_context_parallel")


# label -> (config sections of both runs, sections of the cp run only)
COMPOSED = {
    # host-resident table shards with the row-sparse lazy Adam (the reference: device tables)
    "host_tables_lazy_adam": (
        {"optimizer": {"table_optimizer": "lazy_adam"}},
        {"engram": {"table_location": "host"}},
    ),
    # every block compiled (aot_eager, as tests/test_parallelisms_compile.py), the reference eager
    "compile": ({}, {"compile": {"enable": True, "backend": "aot_eager"}}),
    "lora": ({"training": {"mode": "lora"}}, {}),
}


@pytest.mark.slow
def test_cp_composes_with_host_tables_compile_and_lora(tmp_path):
    """Ulysses cp 2, 3 steps (ULYSSES_STEPS: the compiled run's reference is
    test_cp_layouts_match_single_process's), against one process (test_parallelisms_parity's
    criteria)."""
    import numpy as np
    from test_parallelisms_parity import (
        LR,
        _assert_losses_and_norms_match,
        _assert_matches,
        _initial_weights,
        _train,
        _with,
    )

    for label, (both, cp_only) in COMPOSED.items():
        ref_raw = _with(
            _recipe_raw(str(tmp_path / f"ref-{label}"), 1, {}, ENGRAM_0_2, ULYSSES_STEPS), both
        )
        ref, init = shared_run(_train, 1, ref_raw)[0], _initial_weights(ref_raw)
        raw = _recipe_raw(str(tmp_path / label), 2, {"cp": 2}, ENGRAM_0_2, ULYSSES_STEPS)
        raw = _with(_with(raw, both), cp_only)
        for rank, got in enumerate(run_distributed(_train, 2, raw)):
            where = f"cp2 + {label} (rank {rank})"
            if label != "lora":
                _assert_matches(got, ref, init, where)
                continue
            # _initial_weights builds no adapters: compare the losses, norms and final weights
            _assert_losses_and_norms_match(got, ref, where)
            assert got["weights"].keys() == ref["weights"].keys(), where
            for name, w in ref["weights"].items():
                assert np.abs(got["weights"][name] - w).max() < 0.5 * LR, f"{where}: {name}"


@pytest.mark.parametrize("cp, tp", [(2, 1), (2, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("method", ["ulysses", "allgather_kv"])
def test_batch_split_and_halo_pieces_follow_one_chunk_rule(cp, tp, method):
    """The positions split_batch gives a cp rank (chunk_positions) are those of the halo pieces
    its tp ranks hold (sequence_pieces), in the same order: both read parallel_dims.cp_chunks,
    at the chunk count ParallelDims checks seq_len against."""
    from parallelisms.context_parallel import chunk_positions
    from parallelisms.halo import sequence_pieces
    from parallelisms.parallel_dims import ParallelDims

    dims = ParallelDims(1, 1, tp, 1, cp * tp, cp=cp, cp_method=method)
    pieces = sequence_pieces(cp, tp, dims.cp_load_balanced)
    n_pieces = dims.cp_chunk_count * tp
    assert sorted(p for held in pieces for p in held) == list(range(n_pieces))
    seq = n_pieces * 3
    n = seq // n_pieces  # positions per piece
    for c in range(cp):
        held = [p for t in range(tp) for p in pieces[c * tp + t]]
        from_pieces = [p * n + i for p in held for i in range(n)]
        assert chunk_positions(c, cp, seq, dims.cp_load_balanced).tolist() == from_pieces


def test_chunks_and_halo_pieces_partition_the_sequence():
    """Contiguous chunks, load-balanced chunks (rank i: chunks i and 2 cp - 1 - i), and the halo
    pieces of cp x tp ranks in each rank's local order (TP splits a cp rank's local sequence)."""
    from parallelisms.context_parallel import chunk_positions
    from parallelisms.halo import sequence_pieces

    assert chunk_positions(1, 4, 16, False).tolist() == [4, 5, 6, 7]
    assert chunk_positions(1, 4, 16, True).tolist() == [2, 3, 12, 13]
    for load_balanced in (False, True):
        every = torch.cat([chunk_positions(r, 4, 64, load_balanced) for r in range(4)])
        assert sorted(every.tolist()) == list(range(64))
    assert sequence_pieces(1, 2, False) == [[0], [1]]  # TP alone: the previous TP rank's tail
    assert sequence_pieces(2, 1, True) == [[0, 3], [1, 2]]
    # cp 2 x tp 2, load-balanced: cp rank 0 holds chunks 0 and 3 (pieces 0, 1 and 6, 7)
    assert sequence_pieces(2, 2, True) == [[0, 1], [6, 7], [2, 3], [4, 5]]
    assert sequence_pieces(2, 2, False) == [[0], [1], [2], [3]]
