"""The planner's activation and loss arithmetic against what a real step holds, on CPU: the
tensors autograd saves for a LoRA model, and the peak of live tensors through two optimizer
steps (a dispatch-mode count of live storages) of a cut whose loss sets the peak, as on the H200 (docs/memory_estimate.md).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from launcher import run_isolated
from saved_bytes import check_activation_formula
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from engram.config import load_config
from engram.data.tokenizer import load_tokenizer
from engram.models.args import MODEL_FLAVORS
from engram.models.builder import build_model
from engram.optim.builder import apply_training_mode, build_optimizers
from engram.train.loss import build_loss
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.lora import apply_lora
from planner.estimate import estimate

DEBUG = "train_configs/debug_model.toml"
SMALL = 64 << 10
ROOT = Path(__file__).resolve().parents[1]


def _lora_cfg(name: str, dropout: float, *more: str):
    return load_config(
        [
            *("--job.config_file", DEBUG, "--job.device=cpu", f"--model.name={name}"),
            "--training.mode=lora",
            *("--training.local_batch_size=2", "--training.seq_len=32", "--lora.rank=4"),
            *(f"--lora.dropout={dropout}", "--activation_checkpoint.mode=none", *more),
        ]
    )


@pytest.mark.parametrize("dropout", [0.0, 0.05])  # 0: the fused path; > 0: the generic one
@pytest.mark.parametrize("name", ["llama3", "qwen3"])  # qwen3: frozen q / k norms
def test_lora_activation_formula_matches_saved_tensors(name, dropout):
    """LoRA's saved activations (adapter h, dropout's copy and mask; no normalised x for the
    frozen norms, no input saved by a frozen base linear, nothing by the frozen head) vs the
    bytes autograd saves, fp32 and bf16. Before the LoRA terms the formula was 0.73 of the
    measured bytes with dropout (an under-prediction) and 1.11 without."""
    torch.manual_seed(0)
    cfg = _lora_cfg(name, dropout)

    def lora(model):
        apply_lora(model, cfg.lora)
        apply_training_mode(model, "lora")

    check_activation_formula(cfg, lora)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages on cpu: every storage an op returns counts from its
    creation until it is freed (a weakref finalizer), plus the storages given to `hold`."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def hold(self, tensors) -> None:
        for t in tensors:
            self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self.seen or st.device.type == "meta":
            return
        self.seen[st] = n = st.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def _step_peak_bytes(cfg) -> int:
    """Peak of live tensors over two optimizer steps of `cfg`'s model at one rank, fp32, as
    engram/train/step.py runs them: forward, loss and backward with the model's output held
    until backward ends, the update, then zero_grad(set_to_none=True)."""
    torch.manual_seed(0)
    vocab = load_tokenizer("").vocab_size
    model = build_model(cfg.model, cfg.engram, vocab, {}, "meta", cfg.training.seq_len)
    if cfg.training.mode == "lora":
        apply_lora(model, cfg.lora)
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    apply_training_mode(model, cfg.training.mode)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    optimizers = build_optimizers(model, cfg)
    loss_fn = build_loss(cfg.training.loss_chunks, [model], False)
    shape = (cfg.training.local_batch_size, cfg.training.seq_len)
    ids, labels = torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)
    tracker = LiveBytes()
    tracker.hold([*model.parameters(), *model.buffers()])
    with tracker:
        for _ in range(2):
            output = model(ids)
            loss_fn(output, labels, labels.numel()).backward()
            del output
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return tracker.peak


# The debug flavor at 1/4 width: with the debug tokenizer's 2048 ids the logits set the peak.
MODEL_FLAVORS["llama3"]["debug-narrow"] = MODEL_FLAVORS["llama3"]["debug"].replace(
    dim=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=192
)


@pytest.mark.parametrize(
    ("mode", "flavor", "phase"),
    [
        ("lora", "debug-narrow", "forward end (loss)"),
        ("full", "debug-narrow", "forward end (loss)"),
        ("lora", "debug", "decoder-layer backward"),
        ("full", "debug", "decoder-layer backward"),
    ],
)
def test_planned_peak_covers_a_real_step(mode, flavor, phase):
    """The planner (no fragmentation, no reserve, cpu: no workspace allowance) plans at least
    the measured peak of live tensors of two real fp32 steps at one rank, and at most 15% above
    it; the narrow cut's peak is the loss's backward (as on the H200), the debug width's a
    recomputed layer's backward. Before the fix the planner counted 12 bytes per logit (missing
    the caller's logits, held through backward: 16 in fp32), gradients the previous step had
    freed, no held logits in the backward phases and no LoRA dropout copies and masks: it
    planned 0.79 / 0.84 (narrow LoRA / full) and 0.81 (debug LoRA) of the measured peaks."""
    extra = ["--lora.rank=4", "--lora.dropout=0.05"] if mode == "lora" else []
    cfg = load_config(
        [
            *("--job.config_file", DEBUG, "--job.device=cpu", f"--model.flavor={flavor}"),
            *(f"--training.mode={mode}", "--engram.enabled=false", *extra),
            *("--training.local_batch_size=2", "--training.seq_len=512"),
            *("--activation_checkpoint.mode=full", "--parallelism.mixed_precision_param=float32"),
        ]
    )
    measured = run_isolated(_step_peak_bytes, cfg)
    plan = run_isolated(estimate, cfg, 1, ranks=[0], fragmentation=0.0, reserve_gib=0.0)
    planned = plan.ranks[0].peak_bytes
    assert plan.ranks[0].peak_phase == phase
    # The step's scalars and the norms' per-token rsqrt (under 64 KiB here) are left to the
    # device allowance (planner.estimate.RUNTIME_WORKSPACE_GIB), which cpu plans without.
    assert measured - SMALL <= planned <= 1.15 * measured, (planned, measured, planned / measured)


# Peak active memory (torch.cuda.max_memory_allocated: live tensors) of one trial step of each
# cut, measured on one NVIDIA H200 on 2026-12-03/04 with the code at d499a70, torch 2.11.0+cu130,
# torchao 0.17.0, float32 compute (docs/memory_estimate.md, "Measured on an H200"). Arguments:
# the cut's layer count and its config overrides as the run used them.
F32 = "--parallelism.mixed_precision_param=float32"
H200_ROWS = {
    "32b_gpu, 2 layers": (74.58, 2, ["train_configs/32b_gpu.toml"]),
    "8b_gpu, 4 layers, Engram off": (
        43.85, 4, ["train_configs/8b_gpu.toml", "--parallelism.tp=1", "--engram.enabled=false"]
    ),
    "8b_gpu, 4 layers, Engram on": (52.75, 4, ["train_configs/8b_gpu.toml", "--parallelism.tp=1"]),
    "32b_npu_lora, 2 layers": (
        36.10, 2, ["train_configs/32b_npu_lora.toml", "--job.device=cuda"]
    ),
    "32b_npu_32k, 1 layer, cp 1": (
        72.18, 1, ["train_configs/32b_npu_32k.toml", "--parallelism.cp=1", "--job.device=cuda"]
    ),
    # torch.compile saves fewer activations than the eager formula counts (an upper bound).
    "8b_gpu, 4 layers, compile": (
        50.62, 4, ["train_configs/8b_gpu.toml", "--parallelism.tp=1", "--compile.enable=true"]
    ),
    "8b_gpu, 4 layers, compile + float8": (
        48.31,
        4,
        [
            *("train_configs/8b_gpu.toml", "--parallelism.tp=1", "--compile.enable=true"),
            "--float8.enable=true",
        ],
    ),
}  # fmt: skip


# Caps on planned / measured. Eager rows: the planner's formulas, 15%. Compiled rows are planned
# as eager (the planner builds on the meta device and never sees inductor's graph, whose
# partitioner recomputes pointwise ops the eager formula counts as saved), an upper bound whose
# excess is what compile saved: 2.1 GiB on the 8B cut, 4.4 with float8's casts fused (1.088 and
# 1.148 of measured). Their cap is wider for that stated reason, not fitted to the rows.
EAGER_CAP, COMPILED_CAP = 1.15, 1.20
# The measured figures are quoted to 0.01 GiB: each is known to +-0.005.
QUOTED = 0.005


def _planned_gibs(rows: list[str]) -> dict[str, float]:
    """scripts/cluster_step.py's main (check_cluster's planner child: the cut planned on CPU for
    a cuda device, live tensors only) for each H200 row, in one process (the child runs it as
    a script; test_scripts_check_cluster runs it that way)."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("cluster_step", ROOT / "scripts/cluster_step.py")
    cluster_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cluster_step)
    planned = {}
    for row in rows:
        _, layers, (config, *overrides) = H200_ROWS[row]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cluster_step.main(
                [
                    *("--world", "1", "--layers", str(layers)),
                    *("--job.config_file", config, F32, *overrides),
                ]
            )
        planned[row] = json.loads(out.getvalue().strip().splitlines()[-1])["peak_gib"]
    return planned


@pytest.fixture(scope="module")
def h200_plans() -> dict[str, float]:
    return run_isolated(_planned_gibs, list(H200_ROWS), timeout=600)


@pytest.mark.parametrize("row", list(H200_ROWS))
def test_planner_covers_the_h200_rows(row, h200_plans):
    """Each float32 row of the H200 run is planned at or above its measured peak and at most
    15% above it (20% for compiled rows, planned as eager: see COMPILED_CAP). Before the fix
    the LoRA cut was planned at 34.23 GiB (measured 36.10)."""
    measured, planned = H200_ROWS[row][0], h200_plans[row]
    cap = COMPILED_CAP if "compile" in row else EAGER_CAP
    assert measured <= planned <= cap * measured, (row, planned, measured, planned / measured)


@pytest.mark.parametrize("held_out", list(H200_ROWS))
def test_workspace_allowance_fitted_on_the_other_rows_covers_the_held_out_one(held_out, h200_plans):
    """RUNTIME_WORKSPACE_GIB is fitted: it covers what the rows ran above the modelled tensors
    (cuBLAS / cuBLASLt workspaces and the step's small tensors). Leave one out: fit it on the
    other rows (the largest shortfall of the plan without it), then the held-out row must be
    covered by that fit and the shipped constant must not be below any fit."""
    from planner.estimate import RUNTIME_WORKSPACE_GIB

    def shortfall(row: str) -> float:  # what the plan without the allowance misses, GiB
        return H200_ROWS[row][0] - (h200_plans[row] - RUNTIME_WORKSPACE_GIB)

    fitted = max(max(shortfall(r) for r in H200_ROWS if r != held_out), 0.0)
    assert shortfall(held_out) <= fitted + QUOTED, (held_out, shortfall(held_out), fitted)
    assert fitted <= RUNTIME_WORKSPACE_GIB, fitted
    # the allowance is needed: without it the two rows whose peak it decides are not covered
    assert sorted(r for r in H200_ROWS if shortfall(r) > 0) == [
        "32b_npu_lora, 2 layers", "8b_gpu, 4 layers, Engram off"
    ]  # fmt: skip
