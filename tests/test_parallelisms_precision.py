"""`parallelism.mixed_precision_param` is the compute dtype at every layout, not only under FSDP.

A global forward hook records the input and weight dtype of every decoder `nn.Linear` and of
the output head (the largest matmul of a small model) during a real run of recipes/train.py with mixed_precision_param = "bfloat16": at 1 rank, FSDP 2, TP 2,
PP 2, TP 2 x PP 2 and in LoRA mode at 1 rank, every one must compute in bfloat16, while the
master weights and the optimizer state stay float32 (LoRA's frozen backbone is held in bfloat16,
with no optimizer state). The 1-rank bf16 run must also reproduce the FSDP 2 bf16 run on the
same global batch to bf16 tolerance (both compute in bf16 and reduce in fp32; what differs is
the batch split over ranks, so the fp32 gradient sums and the bf16 matmul blockings differ).

Also: float32 at one rank stays unwrapped (bit-identical to before), cpu_offload is honoured
there, resharding the cast copies changes no number, and the memory planner models the cast.

Layouts are grouped into one launch per world size: each forked rank runs several trainings.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from launcher import run_distributed
from small_job import small_job
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from engram.config import config_from_dict
from engram.models.transformer import clean_fqn
from parallelisms.fsdp import precision_summary
from parallelisms.parallel_dims import ParallelDims

GLOBAL_BATCH = 8
STEPS = 5
BF16 = {"mixed_precision_param": "bfloat16"}
LORA = {"training": {"mode": "lora"}}

# label -> (world, parallelism section, other sections)
LAYOUTS = {
    "one_rank": (1, {**BF16}, {}),
    "lora_one_rank": (1, {**BF16}, LORA),
    "one_rank_reshard": (1, {**BF16, "fsdp_reshard_after_forward": "always"}, {}),
    # float32 at one rank: nothing wrapped (as before); cpu_offload is FSDP2's, so it wraps
    "one_rank_fp32": (1, {}, {}),
    "one_rank_fp32_offload": (1, {"cpu_offload": True}, {}),
    "fsdp2": (2, {"dp_shard": 2, **BF16}, {}),
    "tp2": (2, {"tp": 2, "dp_shard": 1, **BF16}, {}),
    "pp2": (2, {"pp": 2, "dp_shard": 1, **BF16}, {"pipeline": {"schedule": "1F1B"}}),
    "tp2_x_pp2": (4, {"tp": 2, "pp": 2, "dp_shard": 1, **BF16}, {"pipeline": {"schedule": "1F1B"}}),
}  # fmt: skip


def _raw(folder: str, label: str) -> dict:
    world, layout, extra = LAYOUTS[label]
    dp = world // layout.get("tp", 1) // layout.get("pp", 1)
    sections = {
        "engram": {"layer_ids": [0, 2]},
        "training": {"local_batch_size": GLOBAL_BATCH // dp, "max_norm": 1.0},
        "optimizer": {"eps": 1e-6},
        "metrics": {"log_freq": 1},
    }
    for section, values in extra.items():
        sections[section] = {**sections.get(section, {}), **values}
    return small_job(folder, label, world, STEPS, sections, parallelism=layout)


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _train_hooked(rank: int, world: int, raws: dict[str, dict]) -> dict:
    """Train each raw config in turn with the dtype probes on; per layout: what every decoder
    linear saw, the dtypes of the (local) master weights and optimizer state, losses, weights."""
    from recipes.train import train

    lines: list[str] = []  # the "precision: ..." start-up lines (logged once per process)
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("engram.precision").addHandler(handler)
    out = {}
    for label, raw in raws.items():
        seen: dict[int, tuple[str, str]] = {}
        states: set[tuple[str, str]] = set()

        def probe(module, args, output, seen=seen):
            if isinstance(module, nn.Linear) and args:
                seen.setdefault(id(module), (_dtype(args[0]), _dtype(module.weight)))

        def opt_probe(opt, args, kwargs, states=states):
            for state in opt.state.values():
                for k, v in state.items():
                    if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                        states.add((k, _dtype(v)))

        hooks = [
            nn.modules.module.register_module_forward_hook(probe),
            register_optimizer_step_post_hook(opt_probe),
        ]
        try:
            result = train(config_from_dict(raw))
        finally:
            for h in hooks:
                h.remove()
        linears, masters, weights = {}, {}, {}
        for part in result.model_parts:
            for name, m in part.named_modules():
                fqn = clean_fqn(name)
                if isinstance(m, nn.Linear) and (fqn.startswith("layers.") or fqn == "output"):
                    linears[fqn] = seen.get(id(m), ("never called", ""))
            for name, p in part.named_parameters():
                masters[clean_fqn(name)] = (_dtype(p), p.requires_grad)
                full = p.full_tensor() if isinstance(p, DTensor) else p
                weights[clean_fqn(name)] = full.detach().float().clone()
        out[label] = {
            "linears": linears,
            "masters": masters,
            "states": sorted(states),
            "losses": result.losses,
            "grad_norms": result.grad_norms,
            "weights": weights,
            "log": list(lines),
            "wrapped": all(isinstance(part, FSDPModule) for part in result.model_parts),
            "has_head": any(
                getattr(part, "output", None) is not None for part in result.model_parts
            ),
        }
    return out


def _run(tmp_path, labels: list[str]) -> dict[str, list[dict]]:
    """{label: per-rank results}, one launch per world size."""
    by_world: dict[int, dict[str, dict]] = {}
    for label in labels:
        by_world.setdefault(LAYOUTS[label][0], {})[label] = _raw(str(tmp_path / label), label)
    results: dict[str, list[dict]] = {}
    for world, raws in by_world.items():
        per_rank = run_distributed(_train_hooked, world, raws)
        for label in raws:
            results[label] = [r[label] for r in per_rank]
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return _run(tmp_path_factory.mktemp("precision"), list(LAYOUTS))


@pytest.mark.slow
@pytest.mark.parametrize("label", [k for k in LAYOUTS if not k.startswith("one_rank_fp32")])
def test_decoder_linears_and_output_head_compute_in_bf16(runs, label):
    heads = 0
    for rank, got in enumerate(runs[label]):
        where = f"{label} rank {rank}"
        assert got["linears"], f"{where}: no decoder linear on this rank"
        assert ("output" in got["linears"]) == got["has_head"], f"{where}: head not probed"
        heads += got["has_head"]
        wrong = {n: d for n, d in got["linears"].items() if d != ("bfloat16", "bfloat16")}
        assert not wrong, f"{where}: (input, weight) dtypes not bfloat16: {wrong}"
        # fp32 master weights, fp32 Adam state; lora: the frozen backbone held in bf16
        lora = label.startswith("lora")
        for name, (dtype, trainable) in got["masters"].items():
            want = "float32" if trainable or not lora else "bfloat16"
            assert dtype == want, f"{where}: master {name} is {dtype}, want {want}"
        assert got["states"], f"{where}: no optimizer state recorded"
        assert {d for _, d in got["states"]} == {"float32"}, f"{where}: {got['states']}"
        assert got["losses"][-1] < got["losses"][0], f"{where}: did not learn"
        if rank == 0:  # the recipe's log is rank 0's
            assert any("compute bfloat16" in line for line in got["log"]), got["log"]
    assert heads >= 1, f"{label}: no rank holds the output head"


# The two runs compute the same bf16 matmuls on different batch splits and sum the fp32
# gradients over 1 or 2 ranks. Later steps carry bf16 rounding through Adam and the Engram gate's
# signed sqrt, which amplifies it (docs/parallelisms.md, "TP and the Engram gate"); the gate path,
# the tables and the embedding (sparse rows) get the wider update bound. Measured on CPU (1 rank
# bf16 vs FSDP 2 bf16 | 1 rank float32 vs FSDP 2 bf16, what d499a70 ran):
#   step-1 loss 1.9e-7 | 3.3e-5; losses 2.9e-5 | 4.3e-4; step-1 grad norm 2.9e-5 | 2.7e-2;
#   grad norms 8.4e-3 | 2.7e-2; updates: backbone 1.5e-2 | 0.18, gate path 5.8e-2 | 0.40.
STEP1_LOSS_RTOL = 1e-5
LOSS_RTOL = 1e-4
STEP1_GRAD_RTOL = 1e-4
GRAD_RTOL = 2e-2
UPDATE_RTOL = 4e-2
GATE_UPDATE_RTOL = 1.2e-1


@pytest.mark.slow
def test_resharding_the_cast_copies_changes_no_number(runs):
    """fsdp_reshard_after_forward = "always" at one rank frees each layer's bf16 copy after its
    forward and casts it again in backward: the same values, so the same run bit for bit."""
    got, ref = runs["one_rank_reshard"][0], runs["one_rank"][0]
    assert (got["losses"], got["grad_norms"]) == (ref["losses"], ref["grad_norms"])


@pytest.mark.slow
def test_float32_at_one_rank_is_not_wrapped_and_offload_is_honoured(runs):
    """All-float32 at one rank runs unwrapped, as before (nothing to cast). cpu_offload there used
    to be ignored; FSDP2's CPUOffloadPolicy now applies it on the size-1 mesh: losses bit for
    bit, grad norms to the fp32 summation order of a DTensor norm (measured 3.3e-7)."""
    plain, offload = runs["one_rank_fp32"][0], runs["one_rank_fp32_offload"][0]
    assert not plain["wrapped"] and offload["wrapped"] and runs["one_rank"][0]["wrapped"]
    assert plain["linears"]["layers.0.attention.wq"] == ("float32", "float32")
    assert offload["losses"] == plain["losses"]
    torch.testing.assert_close(
        torch.tensor(offload["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=1e-6, atol=0
    )


@pytest.mark.slow
def test_one_rank_bf16_matches_fsdp2_bf16(runs, tmp_path):
    from test_parallelisms_parity import _initial_weights

    ref, got = runs["fsdp2"][0], runs["one_rank"][0]
    close = torch.testing.assert_close
    losses, ref_losses = torch.tensor(got["losses"]), torch.tensor(ref["losses"])
    norms, ref_norms = torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"])
    close(losses[0], ref_losses[0], rtol=STEP1_LOSS_RTOL, atol=0)
    close(losses, ref_losses, rtol=LOSS_RTOL, atol=0)
    close(norms[0], ref_norms[0], rtol=STEP1_GRAD_RTOL, atol=0)
    close(norms, ref_norms, rtol=GRAD_RTOL, atol=0)
    init = _initial_weights(_raw(str(tmp_path), "one_rank"))
    for name, w in ref["weights"].items():
        gate = ".engram." in f".{name}" or name.startswith("tok_embeddings")
        rtol = GATE_UPDATE_RTOL if gate else UPDATE_RTOL
        update = np.linalg.norm(w - init[name])
        err = np.linalg.norm(got["weights"][name] - w)
        assert err <= rtol * update, f"{name}: update differs by {err / update:.2e} > {rtol}"


def test_precision_summary_names_dtype_and_mechanism():
    from engram.config import Parallelism

    one = ParallelDims(dp_replicate=1, dp_shard=1, tp=2, pp=2, world_size=4)
    line = precision_summary(one, Parallelism(**BF16))
    assert "compute bfloat16" in line and "1-rank mesh" in line, line
    line = precision_summary(one, Parallelism())
    assert "compute float32" in line and "nothing cast" in line, line
    ddp = ParallelDims(dp_replicate=2, dp_shard=1, tp=1, pp=1, world_size=2)
    line = precision_summary(ddp, Parallelism(**BF16, mixed_precision_reduce="bfloat16"))
    assert "reduced in bfloat16" in line and "2 dp ranks" in line, line


def test_planner_models_the_cast_at_one_rank():
    """The planner builds the rank with parallelize_model, so at one rank it now sees what the
    recipe runs: lora's frozen backbone held in bf16 (2 B, adapters and Engram 4 B), every
    decoder layer's bf16 copy kept from forward to backward (nothing reshards at size 1) and
    activations in bf16; with float32 compute, no copies (nothing is wrapped)."""
    from launcher import run_isolated

    from engram.data.tokenizer import load_tokenizer
    from engram.hashing.ngram import engram_table_rows
    from engram.models.builder import build_model
    from engram.models.lora import is_lora_param
    from parallelisms.lora import apply_lora
    from planner.estimate import estimate

    def cfg(dtype: str, reshard: str = "default"):
        raw = {
            "model": {"flavor": "debug"},
            "engram": {"layer_ids": [1], "vocab_size_per_ngram": [1009, 997]},
            "training": {"mode": "lora", "seq_len": 64, "local_batch_size": 1},
            "lora": {"rank": 4, "target_modules": ["q_proj", "down_proj"]},
            "parallelism": {"mixed_precision_param": dtype, "fsdp_reshard_after_forward": reshard},
        }
        return config_from_dict(raw)

    bf16, fp32 = (run_isolated(estimate, cfg(d), 1, ranks=[0]) for d in ("bfloat16", "float32"))
    c = cfg("bfloat16")
    model = build_model(
        c.model, c.engram, load_tokenizer("").vocab_size, engram_table_rows(c.engram), "meta",
        c.training.seq_len,
    )  # fmt: skip
    apply_lora(model, c.lora)
    frozen = trainable = in_layers = 0
    for name, p in model.named_parameters():
        if name.endswith("engram.table.weight"):  # FSDP's ignored_params: never cast
            continue
        in_layers += p.numel() if name.startswith("layers.") else 0
        if is_lora_param(name) or ".engram." in name:
            trainable += p.numel()
        else:
            frozen += p.numel()
    m16, m32 = bf16.ranks[0], fp32.ranks[0]
    assert (m16.fsdp.compute_dtype, m32.fsdp.compute_dtype) == ("bfloat16", "float32")
    assert m16.dense_param_bytes == 2 * frozen + 4 * trainable
    assert m32.dense_param_bytes == 4 * (frozen + trainable)
    assert not m16.fsdp.layers_reshard_after_forward
    assert m16.fsdp.layer_gather_bytes == 2 * in_layers
    assert m32.fsdp.layer_gather_bytes == 0
    # "always": only the largest layer's copy and the prefetched next one
    always = run_isolated(estimate, cfg("bfloat16", "always"), 1, ranks=[0]).ranks[0].fsdp
    assert always.layers_reshard_after_forward
    assert always.layer_gather_bytes == 2 * 2 * always.layer_unsharded_params
    assert always.layer_gather_bytes < m16.fsdp.layer_gather_bytes
    saved16, saved32 = (e.stage_activations[0].saved_bytes for e in (bf16, fp32))
    assert saved16 < 0.6 * saved32, (saved16, saved32)
