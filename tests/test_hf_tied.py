"""Tied embeddings through the real recipe path: build on meta -> parallelise -> to_empty ->
init -> (HF load), in recipes/train.py (1 process and FSDP2 over 2 gloo ranks), its DCP
checkpoints, recipes/generate.py and the memory estimator's parameter count.

to_empty() builds a new Parameter per module, which unties a meta-built tied model;
Transformer._apply reties it (tie_weights), so every recipe gets the same single matrix.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from launcher import run_distributed
from safetensors.torch import save_file
from shared_runs import shared_run
from small_job import small_job
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from engram.config import config_from_dict
from engram.data.tokenizer import load_tokenizer
from engram.hf.adapter import to_hf_state_dict
from engram.models.builder import build_from_config
from engram.models.transformer import Transformer, clean_fqn

LR = 1e-3
STEPS = 4


def _raw(folder: str, world: int, **sections: dict) -> dict:
    """The shared small job on the tied qwen3 debug model; `sections` are merged per section."""
    tied = {
        "job": {"seed": 5},
        "model": {"name": "qwen3", "flavor": "debug_tied"},
        "data": {"synthetic_num_entities": 32},
        "optimizer": {"lr": LR, "eps": 1e-6},
        "lr_scheduler": {"warmup_steps": 1},
        "metrics": {"log_freq": 1},
    }
    for name, values in sections.items():
        tied[name] = {**tied.get(name, {}), **values}
    return small_job(folder, f"w{world}", world, STEPS, tied)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _train(rank: int, world: int, raw: dict) -> dict:
    from recipes.train import train

    result = train(config_from_dict(raw))
    model = result.model
    names = [clean_fqn(n) for n, _ in model.named_parameters()]
    optimized = sum(len(g["params"]) for opt in _optimizers_of(raw, model) for g in opt)
    return {
        "losses": result.losses,
        "tied": model.output.weight is model.tok_embeddings.weight,
        "names": names,
        "n_params": len(list(model.parameters())),
        "optimized": optimized,
        "emb": _full(model.tok_embeddings.weight),
        "out": _full(model.output.weight),
        "weights": {clean_fqn(n): _full(p) for n, p in model.named_parameters()},
    }


def _optimizers_of(raw: dict, model: torch.nn.Module) -> list[list[dict]]:
    """The recipe's optimizer construction over the trained model: which tensors it updates."""
    from engram.optim.builder import build_optimizers

    return [opt.param_groups for opt in build_optimizers(model, config_from_dict(raw))]


def _initial(raw: dict) -> torch.Tensor:
    cfg = config_from_dict(raw)
    model, _ = build_from_config(cfg, load_tokenizer(""))
    model.to_empty(device="cpu")
    model.init_weights(seed=cfg.job.seed)
    return model.tok_embeddings.weight.detach().clone()


def test_to_empty_reties() -> None:
    """The defect: nn.Module.to_empty() unties a meta-built model; tie_weights() reties it."""
    cfg = config_from_dict(_raw("unused", 1))
    model, _ = build_from_config(cfg, load_tokenizer(""))
    assert model.output.weight is model.tok_embeddings.weight  # on meta
    model.to_empty(device="cpu")
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())  # one matrix to init / optimize
    model.init_weights(seed=1)
    assert model.output.weight is model.tok_embeddings.weight
    # The untied baseline really does untie: the check above is not vacuous.
    plain = torch.nn.Module()
    plain.a, plain.b = torch.nn.Linear(2, 2, device="meta"), torch.nn.Linear(2, 2, device="meta")
    plain.b.weight = plain.a.weight
    plain.to_empty(device="cpu")
    assert plain.b.weight is not plain.a.weight


@pytest.mark.slow
def test_tied_training_one_matrix_fsdp_matches_single_process(tmp_path):
    """A tied flavor trained from scratch by recipes/train.py updates ONE matrix (output ==
    embedding after training, both moved from init), and FSDP2 and DDP over 2 ranks reproduce
    the single-process run (losses and weights)."""
    single = shared_run(_train, 1, _raw(str(tmp_path), 1))[0]
    init = _initial(_raw(str(tmp_path), 1)).numpy()
    assert single["tied"]
    assert "output.weight" not in single["names"]
    assert single["optimized"] == single["n_params"]
    assert np.array_equal(single["emb"], single["out"])
    assert np.abs(single["emb"] - init).max() > 0.5 * LR  # trained, as one matrix
    runs = [
        (label, rank, got)
        for label, layout in [("fsdp", {}), ("ddp", {"dp_replicate": 2, "dp_shard": 1})]
        for rank, got in enumerate(
            run_distributed(_train, 2, _raw(str(tmp_path / label), 2, parallelism=layout))
        )
    ]
    for label, rank, got in runs:
        where = f"{label} rank {rank}"
        assert got["tied"] and "output.weight" not in got["names"], where
        assert got["optimized"] == got["n_params"], where
        assert np.array_equal(got["emb"], got["out"]), where
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0
        )
        assert got["weights"].keys() == single["weights"].keys(), where
        for name, w in single["weights"].items():
            update = np.linalg.norm(w - (init if name == "tok_embeddings.weight" else w))
            err = np.linalg.norm(got["weights"][name] - w)
            assert np.abs(got["weights"][name] - w).max() < 0.5 * LR, f"{where}: {name}"
            if update:
                assert err / update < 3e-3, f"{where}: {name}"


def _train_with_checkpoint(rank: int, world: int, raw: dict) -> dict:
    from recipes.train import train

    result = train(config_from_dict(raw))
    return {"emb": _full(result.model.tok_embeddings.weight), "losses": result.losses}


@pytest.mark.slow
def test_tied_checkpoint_resume_and_generate(tmp_path):
    """A tied run checkpointed by FSDP2 at world 2: the DCP checkpoint resumes at world 2 to the
    same weights as an uninterrupted run, and recipes/generate.py loads it into the unsharded
    tied model (one matrix, equal to the trained embedding)."""
    from engram.inference import build_for_generation, load_weights

    ckpt = {"enable": True, "interval": 2, "keep_latest_k": 0}
    straight = run_distributed(
        _train_with_checkpoint, 2, _raw(str(tmp_path / "a"), 2, checkpoint=ckpt)
    )[0]
    # Resume a second run from the first run's step-2 checkpoint, which holds the matrix once.
    step2 = tmp_path / "a" / "w2" / "checkpoint" / "step-2"
    saved = FileSystemReader(str(step2)).read_metadata().state_dict_metadata
    assert "model.tok_embeddings.weight" in saved and "model.output.weight" not in saved
    shutil.copytree(step2, tmp_path / "b" / "w2" / "checkpoint" / "step-2")
    resumed = run_distributed(
        _train_with_checkpoint, 2, _raw(str(tmp_path / "b"), 2, checkpoint=ckpt)
    )
    assert resumed[0]["losses"] == straight["losses"][2:]
    assert np.array_equal(resumed[0]["emb"], straight["emb"])

    cfg = config_from_dict(_raw(str(tmp_path / "a"), 2, checkpoint=ckpt))
    model, _, _ = build_for_generation(cfg, 32)
    assert load_weights(model, cfg).startswith("checkpoint")
    assert model.output.weight is model.tok_embeddings.weight
    assert np.array_equal(model.tok_embeddings.weight.detach().numpy(), straight["emb"])


def export_tied_hf(folder, seed: int) -> Transformer:
    """A tied checkpoint as transformers saves one: no lm_head.weight, config.json (v5 layout)
    with tie_word_embeddings true."""
    cfg = config_from_dict(_raw("unused", 1, engram={"enabled": False}))
    model, _ = build_from_config(cfg, load_tokenizer(""))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    args = model.args
    hf = to_hf_state_dict(model.state_dict(), args)
    assert "lm_head.weight" not in hf
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(folder / "model.safetensors"))
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": True, "layer_types": ["full_attention"] * args.n_layers,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.slow
def test_tied_hf_folder_finetune_fsdp_and_generate(tmp_path):
    """model.flavor = 'hf' on a tied folder: recipes/train.py under FSDP2 (2 ranks, engram_only,
    so the frozen backbone must still equal the folder) keeps one matrix equal to the folder's
    embedding; recipes/generate.py loads the same folder into a tied model."""
    from engram.inference import build_for_generation, load_weights

    source = export_tied_hf(tmp_path / "hf", seed=9)
    raw = _raw(
        str(tmp_path), 2,
        model={"flavor": "hf", "hf_checkpoint": str(tmp_path / "hf")},
        engram={"init": "identity"},
        training={"steps": 2, "mode": "engram_only"},
    )  # fmt: skip
    for got in run_distributed(_train, 2, raw):
        assert got["tied"] and "output.weight" not in got["names"]
        assert np.array_equal(got["emb"], source.tok_embeddings.weight.detach().numpy())
        assert np.array_equal(got["out"], got["emb"])
    cfg = config_from_dict(raw)
    model, _, _ = build_for_generation(cfg, 32)
    assert load_weights(model, cfg, source="hf").startswith("HF checkpoint")
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.tok_embeddings.weight, source.tok_embeddings.weight)


def test_estimator_counts_the_tied_matrix_once(tmp_path):
    """The memory estimator builds the recipe's model (meta, FSDP over 2 fake ranks): a tied
    flavor has one vocab x dim matrix fewer than the same untied shape."""
    from launcher import run_isolated

    try:
        from planner.estimate import estimate
    except ImportError:  # before the estimator moves to scripts/
        from recipes.estimate_memory import estimate

    totals = {}
    for flavor in ("debug", "debug_tied"):
        raw = _raw(str(tmp_path), 2, model={"flavor": flavor}, engram={"enabled": False})
        totals[flavor] = run_isolated(estimate, config_from_dict(raw), 2, ranks=[0]).global_params
    vocab = load_tokenizer("").vocab_size
    assert totals["debug"] - totals["debug_tied"] == vocab * 256  # qwen3 debug, dim 256
