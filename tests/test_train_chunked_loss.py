"""Chunked output head + cross-entropy (training.loss_chunks, engram/train/loss.py): same loss and
gradients as the unchunked loss.

Direct: one model, the same batch (with ignored labels), loss and every parameter's gradient
with loss_chunks = 4 and 3 (uneven: 11 + 11 + 10 positions) against 1, fp32, tolerance 1e-5; a
loss scale reaches the gradients; forward-only chunks give the same value; tied embeddings sum
both contributions; FSDP2 reduce-scatters as many times chunked as unchunked.

Run level (the recipe): 3 steps of the debug job with loss_chunks 4 and 3 against 1 at 1 rank
(plus compile + activation checkpointing, gradient accumulation, evaluation), FSDP2 (with
float8; reshard after forward "always" with CPU offload), TP2 with loss parallel (with and
without sequence parallel) and PP2 (1F1B, and the zero-bubble ZBVZeroBubble): per-step losses
and gradient norms, eval losses, and the updated weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from launcher import run_distributed
from small_job import small_job
from test_parallelisms_parity import _assert_losses_and_norms_match
from torch.distributed.tensor import DTensor

from engram.config import ConfigError, config_from_dict
from engram.data.tokenizer import load_tokenizer
from engram.models.builder import build_from_config
from engram.models.transformer import clean_fqn
from engram.train.loss import TargetTokens, build_loss, target_tokens

SEQ = 32


def _model(flavor: str = "debug", name: str = "llama3") -> torch.nn.Module:
    cfg = config_from_dict(
        {"model": {"name": name, "flavor": flavor}, "engram": {"enabled": False}}
    )
    model, _ = build_from_config(cfg, load_tokenizer(""))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def _batch(vocab: int, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, SEQ), generator=g)
    labels = ids.roll(-1, 1)
    labels[0, :5] = -100  # ignored positions: the mean is over the valid tokens only
    labels[1, -3:] = -100
    return ids, labels


def _loss_and_grads(model, ids, labels, chunks: int, scale: float = 1.0):
    model.zero_grad(set_to_none=True)
    model.set_hidden_output(False)
    loss_fn = build_loss(chunks, [model], sharded_logits=False)
    loss = loss_fn(model(ids), labels, target_tokens(labels))
    (loss * scale).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("flavor,name", [("debug", "llama3"), ("debug_tied", "qwen3")])
def test_chunked_matches_unchunked_loss_and_gradients(flavor, name):
    model = _model(flavor, name)
    ids, labels = _batch(model.args.vocab_size)
    ref_loss, ref = _loss_and_grads(model, ids, labels, 1)
    for chunks in (4, 3):
        loss, got = _loss_and_grads(model, ids, labels, chunks)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        for n, g in ref.items():
            # fp32 noise: elementwise 1e-5, or 1e-6 of the tensor's largest entry
            atol = 1e-6 * g.abs().max().item()
            torch.testing.assert_close(got[n], g, rtol=1e-5, atol=atol, msg=f"{chunks}: {n}")
    # The backward's incoming gradient (a loss scale) multiplies both gradients.
    _, half = _loss_and_grads(model, ids, labels, 4, scale=0.5)
    for n, g in ref.items():
        atol = 1e-6 * g.abs().max().item()
        torch.testing.assert_close(half[n], g * 0.5, rtol=1e-5, atol=atol, msg=n)


def test_forward_only_chunks_and_frozen_head():
    model = _model()
    ids, labels = _batch(model.args.vocab_size)
    ref_loss, ref = _loss_and_grads(model, ids, labels, 1)
    loss_fn = build_loss(4, [model], sharded_logits=False)
    with torch.no_grad():
        loss = loss_fn(model(ids), labels, target_tokens(labels))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    # A frozen head (engram_only-like): only the hidden states get a gradient.
    model.zero_grad(set_to_none=True)
    model.output.weight.requires_grad_(False)
    loss_fn(model(ids), labels, target_tokens(labels)).backward()
    assert model.output.weight.grad is None
    w = model.layers["0"].attention.wq.weight
    ref_w = ref["layers.0.attention.wq.weight"]
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-5, atol=1e-6 * ref_w.abs().max().item())


def test_loss_chunks_below_one_or_above_seq_len_is_a_config_error():
    for bad in (0, -2, 65):
        with pytest.raises(ConfigError, match="training.loss_chunks"):
            config_from_dict({"training": {"seq_len": 64, "loss_chunks": bad}})


def _fsdp_grads_and_reduce_scatters(rank: int, world: int, chunks: int) -> dict:
    """FSDP2 over `world` ranks, each its own half batch: full gradients and how many times FSDP
    reduce-scattered (counted at torch.distributed.reduce_scatter_single)."""
    import torch.distributed as dist

    from parallelisms.fsdp import apply_fsdp
    from parallelisms.parallel_dims import ParallelDims

    calls = [0]
    real = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counting
    cfg = config_from_dict(
        {
            "model": {"name": "llama3", "flavor": "debug"},
            "engram": {"enabled": False},
            "parallelism": {"dp_shard": world, "fsdp_reshard_after_forward": "always"},
        }
    )
    dims = ParallelDims(dp_replicate=1, dp_shard=world, tp=1, pp=1, world_size=world)
    dims.build_mesh("cpu")
    model, _ = build_from_config(cfg, load_tokenizer(""))
    apply_fsdp(model, dims, cfg.parallelism, ignored_params=[])
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    ids, labels = _batch(model.args.vocab_size, batch=4)
    loss_fn = build_loss(chunks, [model], sharded_logits=False)
    mine = labels[rank::world]
    divisor = TargetTokens.count([mine], dist.group.WORLD).divisor  # both ranks' targets
    loss_fn(model(ids[rank::world]), mine, divisor).backward()
    grads = {clean_fqn(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"grads": grads, "reduce_scatters": calls[0]}


@pytest.mark.slow
def test_fsdp2_gradients_and_one_reduce_scatter_per_unit():
    ref = run_distributed(_fsdp_grads_and_reduce_scatters, 2, 1)[0]
    assert ref["reduce_scatters"] > 0
    for chunks in (4, 3):
        got = run_distributed(_fsdp_grads_and_reduce_scatters, 2, chunks)[0]
        assert got["reduce_scatters"] == ref["reduce_scatters"], chunks
        for n, g in ref["grads"].items():
            atol = 1e-6 * np.abs(g).max()
            np.testing.assert_allclose(got["grads"][n], g, rtol=1e-5, atol=atol, err_msg=n)


# ------------------------------------------------------------------------------ run level

STEPS = 3
LR = 1e-4  # low: Adam amplifies fp32 noise in near-zero gradients into lr-sized steps
TABLE_LR_MULT = 5.0


def _raw(tmp: str, name: str, world: int, chunks: int, extra: dict) -> dict:
    extra = {
        **extra,
        "training": {**extra.get("training", {}), "loss_chunks": chunks},
        "optimizer": {"lr": LR, "eps": 1e-6, "table_lr_mult": TABLE_LR_MULT},
    }
    raw = small_job(tmp, name, world, STEPS, extra)
    raw["training"]["local_batch_size"] = extra["training"].get(
        "local_batch_size", raw["training"]["local_batch_size"]
    )
    return raw


def _train_all(rank: int, world: int, raws: list[dict]) -> list[dict]:
    from recipes.train import train

    out = []
    for raw in raws:
        result = train(config_from_dict(raw))
        weights = {}
        for part in result.model_parts:
            for n, p in part.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p
                weights[clean_fqn(n)] = full.detach().clone()
        out.append(
            {
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "eval": result.eval_losses,
                "weights": weights,
            }
        )
    return out


def _assert_same_run(got: dict, ref: dict, where: str, adam_steps: float = 0.5) -> None:
    """Losses and grad norms as tests/test_parallelisms_parity.py bounds them (step 1 on identical weights to
    fp32 rounding; later steps 1e-3: Adam turns summation-order noise in near-zero gradient
    entries into up to a step), eval losses, and updated weights within `adam_steps` Adam steps
    (half of one in fp32)."""
    _assert_losses_and_norms_match(got, ref, where)
    close = torch.testing.assert_close
    for step, value in ref["eval"].items():
        close(got["eval"][step], value, rtol=1e-5, atol=0, msg=where)
    assert got["weights"].keys() == ref["weights"].keys(), where
    for n, w in ref["weights"].items():
        bound = adam_steps * LR * (TABLE_LR_MULT if ".table." in n else 1.0)
        assert np.abs(got["weights"][n] - w).max() < bound, f"{where}: {n}"


# label -> (world, config sections); each runs with loss_chunks 1, 4 and 3 in one launch.
RUN_LAYOUTS = {
    "1 rank, compile + AC + grad accumulation + eval": (
        1,
        {
            "compile": {"enable": True, "backend": "aot_eager"},
            "activation_checkpoint": {"mode": "full"},
            "training": {"grad_accum_steps": 2, "local_batch_size": 4},
            "data": {"eval_batches": 2},
        },
    ),
    "FSDP2 + float8 (emulated; the head stays high precision)": (
        2,
        {"float8": {"enable": True, "emulate": True}},
    ),
    "FSDP2 reshard always + CPU offload": (
        2,
        {
            "parallelism": {
                "dp_shard": 2,
                "fsdp_reshard_after_forward": "always",
                "cpu_offload": True,
            }
        },
    ),
    "HSDP 2 x 2": (4, {"parallelism": {"dp_replicate": 2, "dp_shard": 2}}),
    "TP2 loss parallel": (
        2,
        {"parallelism": {"dp_shard": 1, "tp": 2}, "training": {"local_batch_size": 8}},
    ),
    "TP2 loss parallel, no SP": (
        2,
        {
            "parallelism": {"dp_shard": 1, "tp": 2, "tp_sequence_parallel": False},
            "training": {"local_batch_size": 8},
        },
    ),
    "PP2 1F1B + eval": (
        2,
        {
            "parallelism": {"dp_shard": 1, "pp": 2},
            "pipeline": {"schedule": "1F1B", "microbatches": 2},
            "training": {"local_batch_size": 8},
            "data": {"eval_batches": 1},
        },
    ),
    "PP2 ZBVZeroBubble": (
        2,
        {
            "parallelism": {"dp_shard": 1, "pp": 2},
            "pipeline": {"schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 4},
            "training": {"local_batch_size": 8},
        },
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(RUN_LAYOUTS))
def test_recipe_runs_match_unchunked(tmp_path, label):
    world, extra = RUN_LAYOUTS[label]
    raws = [_raw(str(tmp_path), f"c{c}", world, c, extra) for c in (1, 4, 3)]
    for rank, (ref, *runs) in enumerate(run_distributed(_train_all, world, raws)):
        assert ref["losses"][-1] < ref["losses"][0], "reference run did not learn"
        for chunks, got in zip((4, 3), runs, strict=True):
            # float8: the chunked loss's other summation order can flip an e4m3 rounding, and
            # Adam turns the gradient it moves into a step (measured 1.2 steps on an AVX2 CPU).
            steps = 2.0 if "float8" in extra else 0.5
            _assert_same_run(got, ref, f"{label}, rank {rank}, loss_chunks={chunks}", steps)


def test_generation_runs_the_head_on_the_sampled_position_only():
    from engram.inference import generate

    model = _model()
    ids, _ = _batch(model.args.vocab_size)
    seen = []
    model.output.register_forward_hook(lambda _m, inp, _out: seen.append(inp[0].shape[1]))
    with torch.no_grad():
        full = model(ids)
        torch.testing.assert_close(model(ids, last_positions=1), full[:, -1:], rtol=1e-5, atol=1e-6)
        seen.clear()
        generate(model, ids, None, max_new_tokens=2)
    assert seen == [1, 1]


# ------------------------------------------------------------------------------ planner

NPU_32K = "train_configs/32b_npu_32k.toml"


def test_planner_counts_one_chunk_of_logits():
    from engram.config import load_config
    from engram.models.builder import flavor_args
    from planner.activations import loss_bytes

    cfg = load_config(["--job.config_file", NPU_32K])
    args = flavor_args(cfg.model)
    tokens, a, v, d = 32768, 2, args.vocab_size, args.dim
    unchunked = load_config(["--job.config_file", NPU_32K, "--training.loss_chunks=1"])
    # The fp32 log-softmax, its gradient and the logits' gradient, while the caller holds the
    # compute-dtype logits: a + 12 bytes per logit.
    assert loss_bytes(unchunked, args, a, 1, tokens) == (a + 12) * v * tokens
    # 8 chunks: one chunk's logits, the gathered hidden states and their gradient, the head's
    # gradient sum and one chunk's gradient.
    assert cfg.training.loss_chunks == 8
    expected = (a + 12) * v * 4096 + 2 * a * d * tokens + 2 * a * v * d
    assert loss_bytes(cfg, args, a, 1, tokens) == expected
    assert loss_bytes(cfg, args, a, 2, tokens) < expected  # vocabulary-parallel under TP


@pytest.mark.slow
def test_planner_fits_32b_at_32k_on_64_npus_with_cp():
    """Against the usable 60.96 GiB of a "64 GB" NPU (the planner's default budget), the shipped
    CP 2 x FSDP 32 fits; the earlier FSDP-64 + CPU offload layout fits only the nameplate."""
    from planner_runs import planned

    from engram.config import load_config

    cfg = load_config(["--job.config_file", NPU_32K])
    assert cfg.training.seq_len == 32768 and cfg.parallelism.tp == 1 and cfg.parallelism.pp == 1
    assert cfg.parallelism.cp == 2
    est = planned(NPU_32K, world=64, ranks=[0])  # also test_planner_cp's long-context plan
    assert est.fits and est.device_memory_bytes == int(60.96 * 2**30)  # the usable budget
    # The previous layout (FSDP-64 without cp, CPU offload) fitted the 64 GiB nameplate only.
    no_cp = (
        "--parallelism.cp=1",
        "--training.grad_accum_steps=1",
        "--parallelism.cpu_offload=true",
    )
    fsdp64 = planned(NPU_32K, *no_cp, world=64, ranks=[0])
    assert not fsdp64.fits
    assert 61 * 2**30 < fsdp64.ranks[0].peak_bytes < 64 * 2**30
    # FSDP-64 without context parallelism (the config runs CP 2): one sequence's loss alone.
    unchunked = ("--training.loss_chunks=1", "--parallelism.cp=1", "--training.grad_accum_steps=1")
    no_chunks = planned(NPU_32K, *unchunked, world=64, ranks=[0])
    assert not no_chunks.fits
    assert no_chunks.ranks[0].activations.loss_bytes > 55 * 2**30
