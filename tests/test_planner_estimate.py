"""The memory planner (planner/): exact per-rank numbers vs independent splits, and the 32B budget.

The references here never go through FSDP or DTensor: dense shards are the ceil split of dim 0
(FSDP2's torch.chunk split), table rows come from torch.chunk / NgramHasher, and parameter
totals from the published model size and the Engram block's shapes.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from launcher import run_distributed, run_isolated
from saved_bytes import check_activation_formula
from small_job import load_shipped

from engram.config import ConfigError
from engram.data.tokenizer import load_tokenizer
from engram.hashing.ngram import NgramHasher, engram_table_rows
from engram.models.args import get_model_args
from engram.models.builder import build_model
from engram.runtime.device_specs import usable_memory_gib
from planner.activations import _layer_bytes_per_token, activation_estimate
from planner.cli import main
from planner.estimate import estimate
from planner.results import GIB

DEBUG = "train_configs/debug_model.toml"
NPU_32B = "train_configs/32b_npu.toml"
QWEN25_32B_PARAMS = 32_763_876_352  # Qwen2.5-32B (HF config shapes), no Engram


def _estimate(*args, **kwargs):
    # The fake process group and DeviceMesh caches are process-global: run each estimate in a
    # forked child so later multi-process tests do not inherit them (they would mis-place shards).
    return run_isolated(estimate, *args, **kwargs)


def _main(argv):
    return run_isolated(main, argv)


def _cfg(path: str, *overrides: str):
    return load_shipped(path, *overrides)


def _ceil_split(n: int, world: int, rank: int) -> int:
    c = math.ceil(n / world)
    return max(0, min(n, (rank + 1) * c) - rank * c)


def _chunk_rows(rows: int, world: int, rank: int) -> int:
    chunks = torch.chunk(torch.empty(rows, device="meta"), world)
    return chunks[rank].shape[0] if rank < len(chunks) else 0


def _reference_dense(cfg, vocab_size: int, world: int, ranks, only: str = "") -> dict[int, int]:
    """Rank -> dense params: each non-table parameter's dim-0 ceil split, from the unsharded
    meta model (only names containing `only`, if given)."""
    model = build_model(
        cfg.model,
        cfg.engram,
        vocab_size,
        engram_table_rows(cfg.engram),
        "meta",
        cfg.training.seq_len,
    )
    shapes = [
        p.shape
        for name, p in model.named_parameters()
        if not name.endswith("engram.table.weight") and only in f".{name}"
    ]
    return {r: sum(_ceil_split(s[0], world, r) * math.prod(s[1:]) for s in shapes) for r in ranks}


def _engram_dense_params(cfg, dim: int) -> int:
    """Engram block parameters other than the table (value/key projections, 3 norms, conv)."""
    e = cfg.engram
    engram_dim = (e.max_ngram - 1) * e.n_embed_per_ngram
    bias = dim if e.use_bias else 0
    per_layer = (1 + e.hc_mult) * (engram_dim * dim + bias) + 3 * e.hc_mult * dim
    per_layer += e.hc_mult * dim * e.kernel_size  # depthwise conv, no bias
    return per_layer * len(e.layer_ids)


@pytest.mark.parametrize("world", [4, 3])
def test_debug_per_rank_numbers_match_independent_split(world):
    cfg = _cfg(DEBUG)
    est = _estimate(cfg, world, ranks=list(range(world)))
    tok = load_tokenizer(cfg.model.tokenizer_path)
    rows = NgramHasher.from_config(cfg.engram, tok, tok.vocab_size).table_rows
    assert est.table_rows_global == rows
    head_dim = cfg.engram.head_dim
    reference = _reference_dense(cfg, tok.vocab_size, world, range(world))
    for mem in est.ranks:
        dense = reference[mem.rank]
        table_rows = {layer: _chunk_rows(n, world, mem.rank) for layer, n in rows.items()}
        table = sum(table_rows.values()) * head_dim
        assert mem.dense_params == dense
        assert mem.table_rows == table_rows
        assert mem.table_params == table
        assert mem.dense_param_bytes == 4 * dense and mem.table_param_bytes == 4 * table
        assert mem.grad_bytes == 4 * (dense + table)  # training.mode = full: all trainable
        assert mem.optimizer_bytes == 8 * (dense + table)
    # The all-rank view (placement math from one rank) agrees with every rank built for real.
    assert est.all_ranks.dense_params_sum == sum(m.dense_params for m in est.ranks)
    assert est.all_ranks.dense_params_sum == est.global_dense_params
    for layer in rows:
        assert est.all_ranks.table_rows[layer] == [m.table_rows[layer] for m in est.ranks]


def test_engram_only_grads_and_state_cover_engram_params_only():
    cfg = _cfg(DEBUG, "--training.mode=engram_only")
    vocab = load_tokenizer("").vocab_size
    est = _estimate(cfg, 3, ranks=[0, 2])
    reference = _reference_dense(cfg, vocab, 3, [0, 2], only=".engram.")
    for mem in est.ranks:
        engram_dense = reference[mem.rank]
        assert 0 < engram_dense < mem.dense_params
        assert mem.grad_bytes == 4 * (engram_dense + mem.table_params)
        assert mem.optimizer_bytes == 8 * (engram_dense + mem.table_params)


@pytest.fixture(scope="module")
def est_32b():
    """The 32B NPU config at 64 ranks, reduce-scatter every micro-batch."""
    return _estimate(_cfg(NPU_32B), 64, ranks=[0, 63], sync_every_micro_batch=True)


def test_32b_npu_parameter_totals_and_table_rows(est_32b):
    cfg = _cfg(NPU_32B)
    engram_dense = _engram_dense_params(cfg, 5120)
    assert est_32b.global_dense_params == QWEN25_32B_PARAMS + engram_dense
    assert est_32b.all_ranks.dense_params_sum == QWEN25_32B_PARAMS + engram_dense
    reference = _reference_dense(cfg, 152064, 64, [m.rank for m in est_32b.ranks])
    for mem in est_32b.ranks:
        assert mem.dense_params == reference[mem.rank]
    assert est_32b.global_table_params == sum(est_32b.table_rows_global.values()) * 64
    for layer, rows in est_32b.table_rows_global.items():
        expected = [_chunk_rows(rows, 64, r) for r in range(64)]
        assert est_32b.all_ranks.table_rows[layer] == expected
        assert expected[-1] < expected[0]  # prime-sized tables: the last rank holds fewer rows
        for mem in est_32b.ranks:
            assert mem.table_rows[layer] == expected[mem.rank]


def test_32b_npu_fits_in_64gb_with_per_micro_batch_sync(est_32b):
    # job.device = npu: the budget is the usable 60.96 GiB of a "64 GB" NPU, not the nameplate
    assert est_32b.device_memory_bytes == int(usable_memory_gib("npu") * GIB) == int(60.96 * GIB)
    for mem in est_32b.ranks:
        assert mem.peak_bytes < 61 * GIB, f"rank {mem.rank}: {mem.peak_bytes / GIB:.1f} GiB"
    assert est_32b.fits
    # Row sharding vs replicating the tables: the replicated state alone is 16 B/param.
    assert est_32b.replicated_tables.ddp_bytes == 16 * est_32b.global_table_params


@pytest.fixture(scope="module")
def est_32b_recipe():
    """The 32B NPU config at 64 ranks with 2 x 2 micro-batches (the shipped config runs 1 x 4),
    gradient sync as recipes/train.py does it."""
    cfg = _cfg(NPU_32B, "--training.local_batch_size=2", "--training.grad_accum_steps=2")
    return _estimate(cfg, 64, ranks=[63])


def test_32b_recipe_reduce_scatters_every_micro_batch(est_32b_recipe):
    """Under FSDP the recipe never defers the reduce-scatter (grad_accum_steps = 2 here), so no unsharded fp32 gradient (4 B x 32.8 B params per rank) is kept between
    micro-batches (parallelisms.fsdp.defer_grad_sync)."""
    est = est_32b_recipe
    assert not est.recipe_defers_grad_sync and not est.no_sync_accumulation
    assert all(m.fsdp.no_sync_accum_bytes == 0 for m in est.ranks)


def test_32b_npu_fits_in_64gb_as_the_recipe_runs(est_32b_recipe):
    assert est_32b_recipe.fits


@pytest.mark.parametrize("name", ["llama3", "qwen3", "llama3-float8", "llama3-documents"])
def test_activation_formula_matches_saved_tensors(name):
    """The saved-activation formula vs the bytes autograd actually saves (CPU, no checkpointing,
    tables in fp32 as under FSDP, which leaves them out of mixed precision). float8: torchao
    saves the high-precision inputs, so the same formula holds (float8 adds only transients).
    qwen3: q/k norms. documents: packed documents' SDPA mask, saved per layer, at seq_len 256
    (measured: without it the formula gives 0.96 of the bytes, 0.99 at seq_len 32: it grows as
    T^2)."""
    torch.manual_seed(0)
    name, _, variant = name.partition("-")
    float8 = variant == "float8"
    documents = ["--model.attn_mask_type=block_causal", "--engram.respect_doc_boundaries=true"]
    seq = 256 if variant == "documents" else 32
    cfg = _cfg(
        DEBUG, f"--model.name={name}", "--training.local_batch_size=2", f"--training.seq_len={seq}",
        *(documents if variant == "documents" else []),
    )  # fmt: skip

    def to_float8(model):
        if float8:
            from parallelisms.float8 import apply_float8

            cfg.float8.enable = cfg.float8.emulate = True
            assert apply_float8(model, cfg.float8, "cpu", compiled=True)

    check_activation_formula(cfg, to_float8)


def test_cli_markdown_and_json(capfd):
    _main(["--job.config_file", DEBUG, "--world_size", "2", "--ranks", "0,1"])
    md = capfd.readouterr().out
    assert "| per rank | rank 0 | rank 1 | kind |" in md and "Fits: **yes**" in md
    # default budget: the usable memory of an NPU (also for cpu / auto), not the nameplate
    assert "| device memory, GiB | 60.960 | 60.960 | --device_memory_gib |" in md
    json_args = ["--json", "--training.seq_len=64", "--device_memory_gib", "64"]
    _main(["--job.config_file", DEBUG, "--world_size", "2", *json_args])
    data = json.loads(capfd.readouterr().out)
    assert data["seq_len"] == 64 and data["world_size"] == 2 and data["fits"] is True
    assert data["device_memory_bytes"] == 64 * 2**30  # an explicit budget still wins
    assert [r["rank"] for r in data["ranks"]] == [0, 1]


def test_bad_input_names_the_fix():
    with pytest.raises(ConfigError, match="outside 0..1"):
        _estimate(_cfg(DEBUG), 2, ranks=[2])
    with pytest.raises(ConfigError, match="dp_replicate"):
        _estimate(_cfg(DEBUG, "--parallelism.dp_replicate=3"), 4)


def test_float8_on_npu_is_refused():
    with pytest.raises(ConfigError, match="no float8 matmul.*bf16"):
        _estimate(_cfg(NPU_32B, "--float8.enable=true"), 64, ranks=[0])


def test_float8_changes_only_transients():
    """torchao keeps master weights, gradients and optimizer state in high precision: every
    persistent byte is unchanged; the float8 working set of the largest converted linear (the
    FFN's w1, 256 -> 768; the output head and Engram projections stay high precision) is added
    to the decoder-layer backward phase."""
    cfg = _cfg(DEBUG)
    base = _estimate(cfg, 2, ranks=[0])
    f8 = _estimate(_cfg(DEBUG, "--float8.enable=true"), 2, ranks=[0])
    b, f = base.ranks[0], f8.ranks[0]
    assert f8.float8 == "rowwise" and base.float8 == "off" and b.float8_cast_bytes == 0
    assert f.persistent_bytes == b.persistent_bytes
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    assert f.float8_largest_linear.endswith("feed_forward.w1")  # w3 has the same shape
    assert f.float8_cast_bytes == 2 * 256 * 768 + tokens * (256 + 2 * 768)
    phase = "decoder-layer backward"
    assert f.phases[phase] - b.phases[phase] == f.float8_cast_bytes


def test_tp_activation_formula():
    """Per-token layer activations under TP, written out from the shapes (llama3 debug: D 256,
    4 heads of 64, 2 kv heads, F 768; bf16). With sequence parallel the norms are split and the
    column-parallel linears keep their all-gathered input; without it the norms are replicated."""
    cfg = _cfg(DEBUG)
    args = get_model_args("llama3", "debug")
    a, d, dq, f, heads = 2, 256, 256, 768, 4
    norms = 2 * (4 + 2 * a) * d
    attention_ffn = 4 * a * dq + 4 * heads + 4 * a * f
    assert _layer_bytes_per_token(args, a) == norms + attention_ffn
    for tp in (2, 4):
        split = attention_ffn // tp
        assert _layer_bytes_per_token(args, a, tp, sp=True) == norms // tp + 2 * a * d + split
        assert _layer_bytes_per_token(args, a, tp, sp=False) == norms + split
    args.vocab_size = 1000
    one = activation_estimate(cfg, args, "bfloat16")
    two = activation_estimate(cfg, args, "bfloat16", tp=2, sp=True)
    assert two.loss_bytes * 2 == one.loss_bytes  # vocabulary-parallel loss
    assert two.tokens == one.tokens  # every TP rank of a replica sees the same micro-batch
    assert 0.5 * one.saved_bytes < two.saved_bytes < one.saved_bytes


def _real_rank_counts(rank: int, world: int, cfg) -> tuple[int, dict[int, int]]:
    """What a real rank holds after the recipe's build + parallelize (gloo, world ranks)."""
    from engram.models.builder import build_from_config
    from parallelisms.parallel_dims import parallel_dims_from_config
    from parallelisms.parallelize import parallelize_model

    dims = parallel_dims_from_config(cfg, world)
    dims.build_mesh("cpu")
    model, _ = build_from_config(cfg, load_tokenizer(cfg.model.tokenizer_path))
    tables = parallelize_model(model, cfg, dims)
    table_ids = {id(t) for t in tables}
    dense = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel()
        for p in model.parameters()
        if id(p) not in table_ids
    )
    rows = {i: b.table.weight.to_local().shape[0] for i, b in model.engram_blocks().items()}
    return dense, rows


def test_tensor_parallel_per_rank_numbers_match_real_ranks():
    """TP 2 x FSDP 2 at world 4: the fake-process-group numbers (and the all-rank view computed
    from one rank's placements) equal what 4 real gloo ranks hold after parallelize_model."""
    cfg = _cfg(DEBUG, "--parallelism.tp=2")
    est = _estimate(cfg, 4, ranks=list(range(4)))
    real = run_distributed(_real_rank_counts, 4, cfg)
    for mem, (dense, rows) in zip(est.ranks, real, strict=True):
        assert mem.dense_params == dense, mem.rank
        assert mem.table_rows == rows, mem.rank
    assert est.all_ranks.dense_params_sum == sum(d for d, _ in real)
    assert est.all_ranks.dense_params_sum > est.global_dense_params  # norms replicated over TP
    for layer in est.table_rows_global:
        assert est.all_ranks.table_rows[layer] == [r[layer] for _, r in real]


def test_async_checkpoint_staging_is_counted_on_the_host():
    """checkpoint.async_mode = "async" stages a host copy of weights + optimizer state per rank;
    synchronous saves stage nothing, and the device numbers do not change."""
    sync = _estimate(_cfg(DEBUG, "--checkpoint.enable=true"), 2, ranks=[0, 1])
    cfg = _cfg(DEBUG, "--checkpoint.enable=true", "--checkpoint.async_mode=async")
    est = _estimate(cfg, 2, ranks=[0, 1])
    for mem, ref in zip(est.ranks, sync.ranks, strict=True):
        assert ref.async_staging_bytes == 0
        assert mem.async_staging_bytes == (
            mem.dense_param_bytes + mem.table_param_bytes + mem.optimizer_bytes
        )
        assert mem.persistent_bytes == ref.persistent_bytes and mem.peak_bytes == ref.peak_bytes


def test_lora_mode_frozen_backbone_in_compute_dtype():
    """training.mode = "lora" at FSDP 2 with bf16 compute: the frozen backbone is counted at 2
    bytes per parameter, adapters and Engram at 4, and gradients / Adam state exist for the
    adapters and Engram only; references from the unsharded meta model with adapters, ceil
    split over the 2 ranks (FSDP2's split), tables by torch.chunk."""
    from engram.config import config_from_dict
    from engram.models.lora import is_lora_param
    from parallelisms.lora import apply_lora

    raw = {
        "model": {"flavor": "debug"},
        "engram": {"layer_ids": [1], "vocab_size_per_ngram": [1009, 997], "n_head_per_ngram": 2},
        "training": {"mode": "lora", "seq_len": 64, "local_batch_size": 1},
        "lora": {"rank": 4, "target_modules": ["q_proj", "down_proj"]},
        "parallelism": {"dp_shard": 2, "mixed_precision_param": "bfloat16"},
    }
    cfg = config_from_dict(raw)
    est = _estimate(cfg, 2, ranks=[0, 1])
    model = build_model(
        cfg.model, cfg.engram, load_tokenizer("").vocab_size, engram_table_rows(cfg.engram),
        "meta", cfg.training.seq_len,
    )  # fmt: skip
    apply_lora(model, cfg.lora)
    for m in est.ranks:
        frozen = trainable = table = 0
        for name, p in model.named_parameters():
            if name.endswith("engram.table.weight"):
                table += _chunk_rows(p.shape[0], 2, m.rank) * p.shape[1]
                continue
            n = _ceil_split(p.shape[0], 2, m.rank) * math.prod(p.shape[1:])
            if is_lora_param(name) or ".engram." in name:
                trainable += n
            else:
                frozen += n
        assert m.dense_param_bytes == 2 * frozen + 4 * trainable
        assert m.grad_bytes == 4 * (trainable + table)
        assert m.optimizer_bytes == 8 * (trainable + table)
    assert est.training_mode == "lora"


@pytest.mark.parametrize(
    "path", ["train_configs/32b_npu_sft_lora.toml", "train_configs/32b_npu_sft_lora_32k.toml"]
)
def test_sft_lora_configs_plan_within_usable_memory(path):
    """The 32B LoRA + Engram SFT configs (packed conversations, block-causal SDPA mask; 4K rows
    at FSDP 64, 32K rows at CP 2 x FSDP 32) at 64 ranks keep at least 10% of the usable memory
    of a 64 GB NPU free, and their headers state the planned peak."""
    cfg = _cfg(path)
    assert cfg.training.mode == "lora" and cfg.model.attn_mask_type == "block_causal"
    budget = usable_memory_gib("npu")
    est = run_isolated(estimate, cfg, 64, ranks=[0], device_memory_gib=budget, timeout=600)
    peak = est.ranks[0].peak_bytes
    assert est.fits and peak <= 0.9 * budget * GIB, peak / GIB
    header = open(path).read().split("\n[job]")[0]
    assert f"estimated peak {peak / GIB:.1f} GiB of {budget:g} usable" in header
