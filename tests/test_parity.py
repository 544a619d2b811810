"""Run-level parity: every data-parallel layout reproduces the single-process run.

The debug model is trained for 5 steps on the same global batch (8 sequences) by one process and
by 2 / 4 real gloo ranks under DDP, FSDP2 (both reshard policies) and HSDP 2x2, in `full` and
`engram_only` modes, and must match the single-process run:

- per-step losses to rtol 1e-5; the global (pre-clip) gradient norm of step 1 (identical weights)
  to rtol 1e-6, later steps to 1e-3. The gradient norm is what catches a wrong divisor or a shard
  counted twice: Adam itself is blind to gradient scale.
- final fp32 weights: per tensor, the update (final - initial) agrees to 0.1% relative (Frobenius)
  and no element is off by more than half of one Adam step (lr 1e-3, tables 5e-3); frozen tensors
  (engram_only) stay bit-identical. Not tighter because Adam's m/sqrt(v) turns fp32
  summation-order noise in near-zero gradient entries (embedding rows whose contributions almost
  cancel) into a visible fraction of a step; eps 1e-6 bounds that amplification.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from launcher import run_distributed
from torch.distributed.tensor import DTensor

from engram.config import config_from_dict
from engram.data.tokenizer import load_tokenizer
from engram.hashing import NgramHasher
from engram.models.builder import build_model

GLOBAL_BATCH = 8
STEPS = 5
LR = 1e-3
TABLE_LR_MULT = 5.0


def _config(tmp_path: str, world: int, mode: str, layout: dict) -> dict:
    return {
        "job": {
            "dump_folder": tmp_path,
            "run_name": f"w{world}-{mode}",
            "device": "cpu",
            "seed": 3,
        },
        "model": {"name": "llama3", "flavor": "debug"},
        "engram": {
            "layer_ids": [0, 2],
            "n_head_per_ngram": 2,
            "vocab_size_per_ngram": [1009, 997],
            "n_embed_per_ngram": 32,
            "init": "paper",
        },
        "training": {
            "mode": mode,
            "seq_len": 32,
            "local_batch_size": GLOBAL_BATCH // world,
            "steps": STEPS,
            "max_norm": 1.0,
        },
        "data": {"synthetic_num_entities": 64},
        "optimizer": {"lr": LR, "eps": 1e-6, "table_lr_mult": TABLE_LR_MULT},
        "lr_scheduler": {"warmup_steps": 2},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "parallelism": layout,
    }


def _train(rank: int, world: int, raw: dict) -> dict:
    from recipes.train import train

    result = train(config_from_dict(raw))
    weights = {}
    for name, p in result.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        weights[name] = full.detach().clone()
    return {"losses": result.losses, "grad_norms": result.grad_norms, "weights": weights}


def _initial_weights(raw: dict) -> dict[str, np.ndarray]:
    """The weights every layout starts from (init is layout-independent)."""
    cfg = config_from_dict(raw)
    tokenizer = load_tokenizer("")
    hasher = NgramHasher.from_config(cfg.engram, tokenizer, tokenizer.vocab_size)
    model = build_model(
        cfg.model, cfg.engram, tokenizer.vocab_size, hasher.table_rows, device="meta"
    )
    model.to_empty(device="cpu")
    model.init_weights(seed=cfg.job.seed)
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _single_process(tmp_path, mode: str) -> dict:
    return run_distributed(_train, 1, _config(str(tmp_path / "ref"), 1, mode, {}))[0]


LAYOUTS = {
    2: {
        "ddp": {"dp_replicate": 2, "dp_shard": 1},
        "fsdp_reshard_always": {"dp_shard": 2, "fsdp_reshard_after_forward": "always"},
        "fsdp_reshard_never": {"dp_shard": 2, "fsdp_reshard_after_forward": "never"},
    },
    4: {
        "hsdp_2x2": {"dp_replicate": 2, "dp_shard": 2},
        "fsdp": {"dp_shard": 4},
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "engram_only"])
def test_layouts_match_single_process(tmp_path, mode):
    ref = _single_process(tmp_path, mode)
    init = _initial_weights(_config(str(tmp_path), 1, mode, {}))
    if mode == "engram_only":
        changed = {n for n, w in ref["weights"].items() if not np.array_equal(w, init[n])}
        assert changed and all(".engram." in f".{n}" for n in changed), changed
    assert ref["losses"][-1] < ref["losses"][0], "reference run did not learn"
    for world, layouts in LAYOUTS.items():
        for label, layout in layouts.items():
            results = run_distributed(
                _train, world, _config(str(tmp_path / label), world, mode, layout)
            )
            for rank, got in enumerate(results):
                where = f"{label} (world {world}, rank {rank}, {mode})"
                close = torch.testing.assert_close
                close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
                # Step 1 runs on identical weights: its gradient norm must agree to fp32 rounding.
                close(got["grad_norms"][0], ref["grad_norms"][0], rtol=1e-6, atol=0)
                close(
                    torch.tensor(got["grad_norms"]),
                    torch.tensor(ref["grad_norms"]),
                    rtol=1e-3,
                    atol=0,
                )
                assert got["weights"].keys() == ref["weights"].keys(), where
                for name, w in ref["weights"].items():
                    update = np.linalg.norm(w - init[name])
                    err = np.linalg.norm(got["weights"][name] - w)
                    if update == 0:  # frozen in engram_only: must stay bit-identical
                        assert err == 0, f"{where}: frozen {name} changed"
                    else:
                        assert err / update < 1e-3, (
                            f"{where}: {name} update differs by {err / update:.2e} (relative)"
                        )
                        half_step = 0.5 * LR * (TABLE_LR_MULT if ".table." in name else 1.0)
                        assert np.abs(got["weights"][name] - w).max() < half_step, (
                            f"{where}: {name} max |diff|"
                        )
