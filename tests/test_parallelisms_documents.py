"""Packed documents kept apart (model.attn_mask_type = "block_causal") at every layout: step 1 of
the recipe's own pieces (build_model_parts, the loader, TrainStep's cut and forward / backward)
under TP 2, PP 2, CP 2 (Ulysses and all-gather K/V), FSDP 2 (with full activation checkpointing
and the chunked loss) gives the loss and every parameter's gradient of one process on the same
global batch. The batch packs several synthetic facts per sequence, so documents cross the TP
shards, the CP chunks and the ShortConv halos. One launch runs every 2-rank layout.
"""

from __future__ import annotations

import pytest
import torch
from launcher import run_distributed
from test_parallelisms_parity import GLOBAL_BATCH, _config, _with
from torch.distributed.tensor import DTensor

SEQ = 64  # all-gather K/V at cp 2: 4 pieces of 16 >= the ShortConv reach of 9
# Engram at layer 0 only: its ShortConv halo and n-grams cross the TP / CP pieces, and its input
# (the embedding) is the same at every layout. A later Engram layer's signed-sqrt gate amplifies
# the layouts' fp32 summation order (tests/test_parallelisms_tp.py), with or without the mask
# (measured at layer 2, gate-path gradients: TP 2 8.7e-5 / 4.6e-5 causal, all-gather K/V 1.7e-6
# / 3.9e-6 causal); every other gradient stays as below.
DOCUMENTS = {
    "model": {"attn_mask_type": "block_causal"},
    "engram": {"respect_doc_boundaries": True, "layer_ids": [0]},
    "training": {"seq_len": SEQ},
}

# label -> (parallelism section, other sections); every layout runs at 2 ranks
LAYOUTS = {
    "tp2": ({"tp": 2}, {}),
    "pp2": ({"pp": 2}, {}),
    "cp2_ulysses": ({"cp": 2, "cp_method": "ulysses"}, {}),
    "cp2_allgather_kv": ({"cp": 2, "cp_method": "allgather_kv"}, {}),
    "fsdp2_ac_chunked_loss": (
        {"dp_shard": 2},
        {"activation_checkpoint": {"mode": "full"}, "training": {"loss_chunks": 2}},
    ),
}


def _raw(folder: str, world: int, layout: dict, extra: dict) -> dict:
    layout = {"dp_shard": 1, **layout}
    raw = _with(_with(_config(folder, world, "full", layout), DOCUMENTS), extra)
    dp = world // (layout.get("cp", 1) * layout.get("tp", 1) * layout.get("pp", 1))
    raw["training"]["local_batch_size"] = GLOBAL_BATCH // dp
    return raw


def _step_one(rank: int, world: int, raws: list[dict]) -> list[dict]:
    """For each config: step 1's logged loss and every parameter's full gradient on this rank
    (under PP: its stage's), after the step's forward / backward and before any update."""
    from engram.config import config_from_dict
    from engram.data.loader import build_dataloader
    from engram.models.transformer import clean_fqn
    from engram.train.build import build_meta_model, init_process
    from engram.train.loss import TargetTokens
    from engram.train.step import next_batches, ranks_sum
    from parallelisms.parallel_dims import parallel_dims_from_config
    from runner.model_parts import build_model_parts
    from runner.step import TrainStep

    out = []
    for raw in raws:
        cfg = config_from_dict(raw)
        proc = init_process(cfg)
        dims = parallel_dims_from_config(cfg, world)
        dims.build_mesh(proc.device_type)
        tokenizer, hasher, model = build_meta_model(cfg)
        parts, loss_fn, pp = build_model_parts(model, cfg, dims, proc.device)
        dp = dims.mesh("dp")
        loader = build_dataloader(cfg, tokenizer, hasher, dp.get_local_rank(), dims.dp_size)
        step = TrainStep(cfg, dims, parts, loss_fn, [], [], pp=pp)
        batches = [step.cut(b) for b in next_batches(iter(loader), step.accum, proc.device)]
        tokens = TargetTokens.count([b["labels"] for b in batches], step.dp_group)
        with loss_fn.context():  # TP: loss parallel, as the recipe's loop
            loss = ranks_sum(step.forward_backward(batches, tokens), step.dp_group)
        grads = {}
        for part in parts:
            for name, p in part.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[clean_fqn(name)] = g.detach().clone()
        segments = batches[0]["segment_ids"]
        out.append({"loss": loss, "grads": grads, "documents": segments[:, -1] + 1})
    return out


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / b.norm())


@pytest.mark.slow
def test_block_causal_layouts_match_one_process(tmp_path):
    """Measured: losses within 6.3e-8 and every gradient within 6.1e-7 relative (Frobenius; TP 2
    the worst) of one process. The test can fail: with the ShortConv halo blind to documents,
    TP 2 and CP 2 gradients differ by 0.6 (and without the mask the loss moves by 2e-3)."""
    (ref,) = run_distributed(_step_one, 1, [_raw(str(tmp_path / "ref"), 1, {}, {})])[0]
    # Documents per sequence (measured: 3 1 2 1 2 1 3 2): boundaries inside most sequences.
    assert (ref["documents"] > 1).sum() >= GLOBAL_BATCH // 2, ref["documents"]
    raws = [
        _raw(str(tmp_path / label), 2, layout, extra) for label, (layout, extra) in LAYOUTS.items()
    ]
    results = run_distributed(_step_one, 2, raws)
    for i, label in enumerate(LAYOUTS):
        grads = {n: g for rank in results for n, g in rank[i]["grads"].items()}  # PP: union
        assert grads.keys() == ref["grads"].keys(), label
        for rank in results:
            assert _rel(rank[i]["loss"], ref["loss"]) < 1e-6, label
        errs = {n: _rel(g, ref["grads"][n]) for n, g in grads.items()}
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-6, f"{label}: {worst} gradient differs by {errs[worst]:.1e}"
