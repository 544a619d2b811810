"""recipes/train_deepspeed.py: DeepSpeed ZeRO-1/2/3 with the Engram tables outside the engine.

Parity: on 2 real gloo ranks, ZeRO-1, ZeRO-2 and ZeRO-3 (and ZeRO-2 with 2 accumulation
steps, ZeRO-2 with optimizer offload, ZeRO-3 with optimizer + parameter offload, ZeRO-3 with
full activation checkpointing) reproduce the main recipe's FSDP2 run (same global batch of 8, fp32, lr 1e-3 / tables
5e-3, 5 steps, clipping at 1.0 engaged from step 1) with `adam` and `lazy_adam` tables:

- per-step losses to rtol 1e-5 (measured worst 6.3e-6, lazy_adam; adam 1.4e-7);
- the global gradient norm (engine + tables, before clipping) of step 1 to rtol 1e-6 (measured:
  equal), later steps to 2e-3 (measured worst 1.0e-3, lazy_adam step 4; adam 3.7e-4);
- final weights per tensor: |final - FSDP2 final| <= 3e-3 x |FSDP2 update| (measured worst
  4.8e-4), 1e-2 for lazy_adam tables (measured 4.2e-3). The dense gradients are reduced in
  another order (flat ZeRO buckets vs FSDP2's per-parameter reduce-scatter); Adam turns that
  fp32 noise in near-zero gradient entries into a fraction of a step, and lazy Adam, which steps
  every touched row by ~lr whatever its gradient's size, more so (test_parallelisms_parity.py's reasoning).

bf16 weights (ZeRO-2 and ZeRO-3) change the losses and track fp32 to rtol 2e-3.

training.mode = "lora" under ZeRO-1/2/3 reproduces FSDP2's lora run at the same tolerances
(test_lora_under_zero_stages_matches_fsdp2).

Resume from step 3 replays steps 4-5 bit-exactly (losses, norms, weights) for ZeRO-1 / adam,
ZeRO-2 / lazy_adam and ZeRO-3 / adam. One 2-rank launch runs all of it; a second, one-rank
launch resumes step 3 of the 2-rank ZeRO-2 and ZeRO-3 runs (refused until converted to the
universal format, then steps 4-5 match the 2-rank run: _check_universal_resume), checks that a
damaged engine file is named, and that NaN steps are skipped by both the tables and the engine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from launcher import free_port, run_distributed
from test_parallelisms_parity import _config as parity_config
from torch.distributed.tensor import DTensor

from engram.checkpoint import CheckpointError
from engram.checkpoint.deepspeed_folder import load_deepspeed_weights
from engram.config import ConfigError, config_from_dict, load_config
from engram.models.transformer import clean_fqn

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[1]


def _config(folder: str, world: int, table_optimizer: str, **sections) -> dict:
    """test_parallelisms_parity.py's job (debug model, Engram at layers 0 and 2, global batch 8, lr 1e-3, eps
    1e-6, 5 steps, max_norm 1.0) with the given table optimizer and sections."""
    raw = parity_config(folder, world, "full", {})
    raw["job"]["run_name"] = "run"
    raw["data"]["eval_batches"] = 0
    raw["optimizer"]["table_optimizer"] = table_optimizer
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def _full(p: torch.Tensor) -> np.ndarray:
    from deepspeed.utils import safe_get_full_fp32_param

    if isinstance(p, DTensor):
        return p.full_tensor().detach().numpy().copy()
    full = safe_get_full_fp32_param(p)  # collective under ZeRO; None for a plain tensor
    return (p if full is None else full).detach().numpy().copy()


def _run_fsdp(raw: dict) -> dict:
    from recipes.train import train

    result = train(config_from_dict(raw))
    weights = {clean_fqn(n): _full(p) for n, p in result.model.named_parameters()}
    return {"losses": result.losses, "grad_norms": result.grad_norms, "weights": weights}


def _run_deepspeed(raw: dict) -> dict:
    from recipes.train_deepspeed import train

    result = train(config_from_dict(raw))
    weights = {clean_fqn(n): _full(p) for n, p in result.engine.module.named_parameters()}
    weights.update({clean_fqn(n): _full(p) for n, p in result.tables.named_parameters()})
    return {"losses": result.losses, "grad_norms": result.grad_norms, "weights": weights}


# label -> (zero stage, table optimizer, extra config sections)
VARIANTS = {
    "zero1_adam": (1, "adam", {}),
    "zero2_adam": (2, "adam", {}),
    "zero3_adam": (3, "adam", {}),
    "zero1_lazy_adam": (1, "lazy_adam", {}),
    "zero2_lazy_adam": (2, "lazy_adam", {}),
    "zero3_lazy_adam": (3, "lazy_adam", {}),
    "zero2_adam_offload_optimizer": (
        2,
        "adam",
        {"deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"}},
    ),
    "zero3_adam_offload_param": (
        3,
        "adam",
        {"deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}},
    ),
    "zero3_adam_activation_checkpoint": (3, "adam", {"activation_checkpoint": {"mode": "full"}}),
    "zero2_adam_grad_accum": (
        2,
        "adam",
        {"training": {"local_batch_size": 2, "grad_accum_steps": 2}},
    ),
}
# Resumed from step 3 of the run above (checkpoint interval 3): steps 4-5 must be identical.
RESUMED = ("zero1_adam", "zero2_lazy_adam", "zero3_adam")
# Variants that write checkpoints (steps 3 and 5): those resumed, zero2_adam (its step 3 is
# resumed from the universal format by _refusals) and the offload layouts (a save under offload
# is its own path). The others train without saving: no check reads their folders, and two
# 67 MiB saves per run were most of their wall time.
SAVED = (*RESUMED, "zero2_adam", "zero2_adam_offload_optimizer", "zero3_adam_offload_param")


def _parity_and_resume(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    for opt in ("adam", "lazy_adam"):
        ref = _config(f"{root}/fsdp_{opt}", world, opt, parallelism={"dp_shard": world})
        out[f"fsdp_{opt}"] = _run_fsdp(ref)
    for label, (stage, opt, extra) in VARIANTS.items():
        raw = _config(
            f"{root}/{label}",
            world,
            opt,
            checkpoint={"enable": label in SAVED, "interval": 3, "keep_latest_k": 0},
            **{"deepspeed": {"zero_stage": stage}, **extra},
        )
        out[label] = _run_deepspeed(raw)
        if label in RESUMED:
            raw["checkpoint"]["load_step"] = 3
            resumed = _run_deepspeed(raw)
            out[f"{label}_resumed"] = resumed
    # bf16 weights (the accelerator setting): ZeRO-2 (cast by deepspeed.initialize) and ZeRO-3
    # (cast per block before partitioning) hold the same bf16 weights.
    for stage in (2, 3):
        raw = _config(
            f"{root}/bf16_zero{stage}",
            world,
            "adam",
            deepspeed={"zero_stage": stage},
            parallelism={"mixed_precision_param": "bfloat16"},
        )
        out[f"bf16_zero{stage}"] = _run_deepspeed(raw)
    # model.hf_checkpoint: the ZeRO-3 run's weights as an HF folder, loaded by FSDP2 and ZeRO-3.
    hf = f"{root}/hf"
    if rank == 0:
        _export_hf(f"{root}/zero3_adam/run/checkpoint/step-5", hf)
    torch.distributed.barrier()
    for label, run, sections in (
        ("hf_fsdp", _run_fsdp, {"parallelism": {"dp_shard": world}}),
        ("hf_zero3", _run_deepspeed, {"deepspeed": {"zero_stage": 3}}),
    ):
        raw = _config(f"{root}/{label}", world, "adam", **sections)
        raw["model"]["hf_checkpoint"] = hf
        raw["training"]["steps"] = 2
        with _recorded_hf_reads() as reads:
            out[label] = run(raw)
        out[label]["hf_reads"] = reads
    return out


@contextlib.contextmanager
def _recorded_hf_reads():
    """The parameter names handed to each HFLoadPlan.read_into call."""
    from engram.hf.load import HFLoadPlan

    real, reads = HFLoadPlan.read_into, []

    def recording(self, params):
        reads.append(sorted(params))
        return real(self, params)

    HFLoadPlan.read_into = recording
    try:
        yield reads
    finally:
        HFLoadPlan.read_into = real


def _export_hf(step_dir: str, out: str) -> None:
    from engram.data.tokenizer import load_tokenizer
    from engram.hf.export import export
    from engram.models.builder import build_hasher

    raw = _config("unused", 1, "adam")
    model = _unsharded_model(raw)
    load_deepspeed_weights(model, Path(step_dir))
    tokenizer = load_tokenizer("")
    hasher = build_hasher(config_from_dict(raw), tokenizer)
    export(model, "llama3", raw["engram"], {}, out, tokenizer=tokenizer, hasher=hasher)


def _unsharded_model(raw: dict) -> torch.nn.Module:
    from engram.data.tokenizer import load_tokenizer
    from engram.models.builder import build_from_config

    cfg = config_from_dict(raw)
    model, _ = build_from_config(cfg, load_tokenizer(""))
    model.to_empty(device="cpu")
    model.init_weights(seed=cfg.job.seed)
    return model


def _initial_weights(raw: dict) -> dict[str, np.ndarray]:
    """The weights every layout starts from (init is layout-independent)."""
    return {n: p.detach().numpy().copy() for n, p in _unsharded_model(raw).named_parameters()}


def _refusals(rank: int, world: int, root: str, runs: str) -> dict:
    """In this 1-rank run: step 3 of the 2-rank ZeRO-2 and ZeRO-3 runs (`runs`) resumed from
    the universal checkpoint (_universal_resume); the ZeRO-3 step 5 with one engine file
    damaged: refused naming that file; the non-finite guard."""
    errors: dict = {"universal": {}}
    for stage in (2, 3):
        errors["universal"][stage] = _universal_resume(
            f"{root}/universal{stage}", world, runs, stage
        )
    raw = _config(
        f"{root}/damaged", world, "adam", deepspeed={"zero_stage": 3}, checkpoint={"enable": True}
    )
    shutil.copytree(f"{runs}/zero3_adam/run/checkpoint", f"{root}/damaged/run/checkpoint")
    victim = sorted(Path(f"{root}/damaged/run/checkpoint/step-5/engine/model").glob("*optim*"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    try:
        _run_deepspeed(raw)
    except CheckpointError as e:
        errors["damaged"] = str(e)
    errors["victim"] = victim.name
    errors["nonfinite"] = _nonfinite(f"{root}/nonfinite", world)
    return errors


def _universal_resume(folder: str, world: int, runs: str, stage: int) -> dict:
    """Step 3 of the 2-rank ZeRO-`stage` run resumed by this `world`-rank run (same global
    batch): refused until the step folder is converted (scripts/deepspeed_universal.py for
    ZeRO-2, its function for ZeRO-3), then steps 4-5 from the universal checkpoint."""
    from runner.deepspeed_engine import convert_to_universal

    shutil.copytree(
        f"{runs}/zero{stage}_adam/run/checkpoint/step-3", f"{folder}/run/checkpoint/step-3"
    )
    step3 = f"{folder}/run/checkpoint/step-3"
    raw = _config(
        folder,
        world,
        "adam",
        deepspeed={"zero_stage": stage},
        checkpoint={"enable": True, "interval": 3, "keep_latest_k": 0, "load_step": 3},
    )
    out: dict = {}
    try:
        _run_deepspeed(raw)
    except CheckpointError as e:
        out["refused"] = str(e)
    if stage == 2:  # the command the refusal names, as a user runs it
        proc = subprocess.run(
            [sys.executable, "scripts/deepspeed_universal.py", step3],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        convert_to_universal(Path(step3))
    out.update(_run_deepspeed(raw))
    return out


@contextlib.contextmanager
def _faulty(attr: str, calls: tuple[int, ...], fault):
    """`attr` of the DeepSpeed recipe's step (runner.engine_step; "summed_cross_entropy": the
    loss, engram.train.loss's) runs as `fault(real, *args)` on its `calls`-th calls (counted
    from 1), as itself otherwise."""
    import engram.train.loss
    import runner.engine_step

    recipe = engram.train.loss if attr == "summed_cross_entropy" else runner.engine_step
    real, n = getattr(recipe, attr), [0]

    def wrapped(*args):
        n[0] += 1
        return fault(real, *args) if n[0] in calls else real(*args)

    setattr(recipe, attr, wrapped)
    try:
        yield
    finally:
        setattr(recipe, attr, real)


def _nan_loss(summed_cross_entropy, logits, labels):
    return summed_cross_entropy(logits, labels) * math.nan  # so every gradient is NaN


def _nan_table_grads(clip, engine, table_params, max_norm):
    for p in table_params:
        if p.grad is not None:
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).fill_(math.nan)
    return clip(engine, table_params, max_norm)


def _nonfinite(folder: str, world: int) -> dict:
    """Steps 2 and 3 with a NaN loss (so NaN gradients): both updates skipped, engine and tables."""
    import recipes.train_deepspeed as recipe

    with _faulty("summed_cross_entropy", (2, 3), _nan_loss):
        raw = _config(folder, world, "lazy_adam", deepspeed={"zero_stage": 2})
        raw["training"]["steps"] = 4
        result = recipe.train(config_from_dict(raw))
    params = [*result.engine.module.parameters(), *result.tables.parameters()]
    finite = all(bool(torch.isfinite(_full_tensor(p)).all()) for p in params)
    out = {
        "losses": result.losses,
        "finite": finite,
        "engine_skipped": result.engine.skipped_steps,
    }
    out["tables_only"] = {stage: _nonfinite_tables_only(folder, world, stage) for stage in (2, 3)}
    return out


def _nonfinite_tables_only(folder: str, world: int, stage: int) -> dict:
    """Two 3-step runs: (a) step 2's table gradients alone are NaN (the engine's are finite);
    (b) step 2's loss is NaN (every gradient NaN: DeepSpeed itself discards its update). In both
    step 2 must change nothing, so step 3's loss and the final weights agree bit for bit; had
    the engine applied its step-2 update in (a), they would not."""
    out = {}
    for label, attr, fault in (
        ("tables", "clip_engine_and_tables_", _nan_table_grads),
        ("loss", "summed_cross_entropy", _nan_loss),
    ):
        with _faulty(attr, (2,), fault):
            raw = _config(
                f"{folder}/{label}{stage}", world, "adam", deepspeed={"zero_stage": stage}
            )
            raw["training"]["steps"] = 3
            out[label] = _run_deepspeed(raw)
    return out


def _full_tensor(p: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(_full(p))


@pytest.mark.slow
def test_zero_stages_match_fsdp2_and_resume_exactly(tmp_path):
    init = _initial_weights(_config(str(tmp_path), 1, "adam"))
    got = run_distributed(_parity_and_resume, 2, str(tmp_path), timeout=900)[0]
    close = torch.testing.assert_close
    for label, (_, opt, _) in VARIANTS.items():
        ref, run = got[f"fsdp_{opt}"], got[label]
        where = f"{label} vs FSDP2 ({opt} tables)"
        assert ref["losses"][-1] < ref["losses"][0], "reference run did not learn"
        assert max(ref["grad_norms"]) > 1.0, "clipping (max_norm 1.0) never engaged"
        losses, norms = torch.tensor(run["losses"]), torch.tensor(run["grad_norms"])
        close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=0, msg=where)
        # Step 1 (identical weights): the global norm over engine + tables to fp32 rounding.
        close(norms[0].item(), ref["grad_norms"][0], rtol=1e-6, atol=0, msg=where)
        close(norms, torch.tensor(ref["grad_norms"]), rtol=2e-3, atol=0, msg=where)
        assert run["weights"].keys() == ref["weights"].keys(), where
        for name, w in ref["weights"].items():
            err = np.linalg.norm(run["weights"][name] - w)
            update = np.linalg.norm(w - init[name])
            assert update > 0, f"{where}: {name} not trained"
            tol = 1e-2 if opt == "lazy_adam" and ".table." in name else 3e-3
            assert err <= tol * update, f"{where}: {name} update differs by {err / update:.2e}"
    for label in RESUMED:
        resumed, full = got[f"{label}_resumed"], got[label]
        assert resumed["losses"] == full["losses"][3:], label  # bit-exact
        assert resumed["grad_norms"] == full["grad_norms"][3:], label
        for name, w in full["weights"].items():
            assert np.array_equal(resumed["weights"][name], w), f"{label} resumed: {name}"

    fp32 = got["zero3_adam"]["losses"]
    for stage in (2, 3):
        bf16 = got[f"bf16_zero{stage}"]["losses"]
        assert bf16[0] != fp32[0], f"ZeRO-{stage}: bf16 had no effect"
        close(torch.tensor(bf16), torch.tensor(fp32), rtol=2e-3, atol=0)
    close(got["bf16_zero3"]["losses"][0], got["bf16_zero2"]["losses"][0], rtol=1e-6, atol=0)
    # HF backbone load: ZeRO-3 (loaded, then partitioned) starts where FSDP2 does, from the
    # trained weights (a lower loss than a fresh init).
    hf_fsdp, hf_zero3 = got["hf_fsdp"], got["hf_zero3"]
    close(torch.tensor(hf_zero3["losses"]), torch.tensor(hf_fsdp["losses"]), rtol=1e-5, atol=0)
    close(hf_zero3["grad_norms"][0], hf_fsdp["grad_norms"][0], rtol=1e-6, atol=0)
    assert hf_fsdp["losses"][0] < got["zero3_adam"]["losses"][-1] + 0.05, hf_fsdp["losses"]
    # ZeRO-3 reads the folder one block at a time (embedding, each layer, norm, output, then the
    # tables), never the whole model at once; FSDP2 reads its (sharded) model in one call.
    (whole,) = hf_fsdp["hf_reads"]
    blocks = hf_zero3["hf_reads"]
    assert sorted(n for b in blocks for n in b) == whole, "ZeRO-3 read other parameters"
    n_layers = len({n.split(".")[1] for n in whole if n.startswith("layers.")})
    assert len(blocks) == n_layers + 4, [b[:2] for b in blocks]
    assert all(".table." in n for n in blocks[-1]), blocks[-1]
    for b in blocks[:-1]:
        assert len({n.split(".")[1] for n in b if n.startswith("layers.")}) <= 1, b
    # The export path (scripts/export_hf.py): one process, zero_to_fp32 + the tables' DCP shards.
    for label in ("zero2_lazy_adam", "zero3_adam"):
        model = _unsharded_model(_config(str(tmp_path), 1, "adam"))
        load_deepspeed_weights(model, tmp_path / label / "run" / "checkpoint" / "step-5")
        for name, p in model.named_parameters():
            assert np.array_equal(p.detach().numpy(), got[label]["weights"][name]), (label, name)

    (errors,) = run_distributed(_refusals, 1, str(tmp_path / "one"), str(tmp_path))
    for stage, resumed in errors["universal"].items():
        _check_universal_resume(tmp_path, stage, resumed, got[f"zero{stage}_adam"])
    assert "damaged" in errors["damaged"] and errors["victim"] in errors["damaged"], errors
    nonfinite = errors["nonfinite"]
    losses = nonfinite["losses"]
    assert np.isfinite(losses[0]) and np.isnan(losses[1]) and np.isnan(losses[2]), losses
    assert np.isfinite(losses[3]) and nonfinite["finite"], nonfinite
    assert nonfinite["engine_skipped"] == 2, nonfinite
    for stage, runs in nonfinite["tables_only"].items():
        tables, loss = runs["tables"], runs["loss"]
        assert np.isfinite(tables["losses"][1]) and np.isnan(tables["grad_norms"][1]), tables
        assert np.isnan(loss["losses"][1]), loss
        assert tables["losses"][2] == loss["losses"][2], (stage, tables, loss)
        for name, w in loss["weights"].items():
            assert np.array_equal(tables["weights"][name], w), f"ZeRO-{stage}: {name}"


def _check_universal_resume(tmp_path: Path, stage: int, resumed: dict, full: dict) -> None:
    """A 2-rank ZeRO-`stage` checkpoint of step 3 resumed at 1 rank from its universal
    conversion: refused before the conversion with the command; steps 4-5 then reproduce the
    uninterrupted 2-rank run (same global batch) to the parity tolerances: losses rtol 1e-5,
    weights within 1e-3 of the steps-4-5 update (measured: losses 7e-8 / 1.4e-7, weights
    1.8e-6 / 2.0e-5 for ZeRO-2 / ZeRO-3; with the Adam moments zeroed after the load 1.1, with
    ZeRO-3's load unrepaired 0.27). The converted files are in the step's manifest: one damaged
    byte is reported."""
    from engram.checkpoint import verify_checkpoint

    step3 = tmp_path / "one" / f"universal{stage}" / "run" / "checkpoint" / "step-3"
    where = f"ZeRO-{stage} resumed at 1 rank from the universal checkpoint"
    refused = resumed["refused"]
    assert "written by 2 ranks, this run has 1" in refused, refused
    assert f"python scripts/deepspeed_universal.py {step3}" in refused, refused
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(full["losses"][3:]), rtol=1e-5, atol=0,
        msg=where,
    )  # fmt: skip
    at_step3 = _unsharded_model(_config(str(tmp_path), 1, "adam"))
    load_deepspeed_weights(
        at_step3, tmp_path / f"zero{stage}_adam" / "run" / "checkpoint" / "step-3"
    )
    worst = 0.0
    for name, p in at_step3.named_parameters():
        w = full["weights"][name]
        update = np.linalg.norm(w - p.detach().numpy())
        assert update > 0, f"{where}: {name} not trained in steps 4-5"
        worst = max(worst, np.linalg.norm(resumed["weights"][name] - w) / update)
    assert worst <= 1e-3, f"{where}: weights differ by {worst:.2e} of the steps-4-5 update"
    listed = json.loads((step3 / "manifest.json").read_text())["files"]
    converted = sorted(n for n in listed if n.startswith("engine/model_universal/"))
    assert any(n.endswith("/exp_avg_sq.pt") for n in converted), converted
    assert not verify_checkpoint(step3, collective=False)
    victim = step3 / converted[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    problems = verify_checkpoint(step3, collective=False)
    assert any(converted[0] in p and "damaged" in p for p in problems), problems


# ----------------------------------------------------------------------------- LoRA

LORA = {"training": {"mode": "lora"}, "lora": {"rank": 4, "alpha": 8.0}}


def _lora_trainable(named) -> dict[str, np.ndarray]:
    """The weights lora mode trains (adapters, Engram), gathered in full."""
    from engram.optim.builder import is_trainable

    return {clean_fqn(n): _full(p) for n, p in named if is_trainable(clean_fqn(n), "lora")}


def _lora_runs(rank: int, world: int, root: str) -> dict:
    from recipes.train import train as train_fsdp
    from recipes.train_deepspeed import train as train_ds

    out: dict = {}
    fsdp = _config(f"{root}/fsdp", world, "adam", parallelism={"dp_shard": world}, **LORA)
    result = train_fsdp(config_from_dict(fsdp))
    out["fsdp"] = {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "weights": _lora_trainable(result.model.named_parameters()),
    }
    for stage in (1, 2, 3):
        raw = _config(f"{root}/zero{stage}", world, "adam", deepspeed={"zero_stage": stage}, **LORA)
        result = train_ds(config_from_dict(raw))
        named = [*result.engine.module.named_parameters(), *result.tables.named_parameters()]
        out[f"zero{stage}"] = {
            "losses": result.losses,
            "grad_norms": result.grad_norms,
            "weights": _lora_trainable(named),
        }
    return out


@pytest.mark.slow
def test_lora_under_zero_stages_matches_fsdp2(tmp_path):
    """training.mode = lora: ZeRO-1/2/3 at 2 ranks get the adapters of train.py's converter
    (parallelize.convert_model) and reproduce its FSDP2 lora run (5 steps) at the FSDP2
    tolerances above: losses, global grad norms, adapter and Engram weights. Measured: ZeRO-1/2
    losses equal, norms 1.3e-6, weights 1.4e-5 of the update; ZeRO-3 losses 2.5e-7, norms
    6.0e-4, weights 2.5e-3 (a lora_A: its gradient is 0 at step 1, while B = 0, so its update
    is small and Adam makes more of the fp32 reduction-order noise)."""
    from engram.data.tokenizer import load_tokenizer
    from engram.models.builder import build_from_config
    from parallelisms.lora import apply_lora

    cfg = config_from_dict(_config(str(tmp_path), 1, "adam", **LORA))
    model, _ = build_from_config(cfg, load_tokenizer(""))  # the weights every layout starts from
    apply_lora(model, cfg.lora)
    model.to_empty(device="cpu")
    model.init_weights(seed=cfg.job.seed)
    init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    got = run_distributed(_lora_runs, 2, str(tmp_path), timeout=900)[0]
    ref = got["fsdp"]
    assert any(n.endswith("lora_B") for n in ref["weights"]), sorted(ref["weights"])
    assert ref["losses"][-1] < ref["losses"][0], "reference lora run did not learn"
    close = torch.testing.assert_close
    for stage in (1, 2, 3):
        run, where = got[f"zero{stage}"], f"lora ZeRO-{stage} vs FSDP2"
        assert run["weights"].keys() == ref["weights"].keys(), where  # the adapters are wired
        close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0,
              msg=where)  # fmt: skip
        close(run["grad_norms"][0], ref["grad_norms"][0], rtol=1e-6, atol=0, msg=where)
        close(torch.tensor(run["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=2e-3,
              atol=0, msg=where)  # fmt: skip
        for name, w in ref["weights"].items():
            err = np.linalg.norm(run["weights"][name] - w)
            update = np.linalg.norm(w - init[name])
            assert update > 0, f"{where}: {name} not trained"
            assert err <= 3e-3 * update, f"{where}: {name} update differs by {err / update:.2e}"


# ----------------------------------------------------------------------------- bad input


def _ds_config(tmp_path, user: dict | str | None = None, **sections):
    from runner.deepspeed_engine import build_ds_config

    raw = _config(str(tmp_path), 2, "adam", **sections)
    if user is not None:
        path = tmp_path / "ds_config.json"
        path.write_text(user if isinstance(user, str) else json.dumps(user))
        raw.setdefault("deepspeed", {})["config_json"] = str(path)
    return build_ds_config(config_from_dict(raw), world_size=2)


def test_ds_config_from_the_toml(tmp_path):
    ds = _ds_config(tmp_path, deepspeed={"zero_stage": 3, "offload_param": "cpu"})
    assert ds["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "none"},
        "offload_param": {"device": "cpu"},
    }
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["train_batch_size"] == 8
    assert ds["gradient_clipping"] == 0.0 and ds["bf16"] == {"enabled": False}
    assert ds["zero_allow_untested_optimizer"] is True


def test_ds_config_json_merges_and_auto_takes_the_toml(tmp_path):
    user = {
        "train_micro_batch_size_per_gpu": "auto",
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 12345},
        "wall_clock_breakdown": False,
    }
    ds = _ds_config(tmp_path, user, deepspeed={"zero_stage": 2})
    assert ds["zero_optimization"]["reduce_bucket_size"] == 12345
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["wall_clock_breakdown"] is False


@pytest.mark.parametrize(
    "user, match",
    [
        (
            {"zero_optimization": {"stage": 3}},
            r"zero_optimization.stage = 3 .*deepspeed.zero_stage = 2",
        ),
        (  # the TOML's true max_norm, not the 0.0 the recipe hands DeepSpeed
            {"gradient_clipping": 1.0},
            r"gradient_clipping = 1.0 but the recipe sets 0.0 \(training.max_norm = 1.0 is",
        ),
        ({"train_batch_size": 16}, r"train_batch_size = 16 .*training.local_batch_size"),
        ({"fp16": {"enabled": True}}, r"fp16: refused.*loss scaler.*Engram table"),
        ({"optimizer": {"type": "Adam"}}, r"'optimizer' section.*\[optimizer\]"),
        ("{not json", r"deepspeed.config_json = .* is not a readable JSON file"),
    ],
)
def test_ds_config_json_conflicts_are_errors(tmp_path, user, match):
    with pytest.raises(ConfigError, match=match):
        _ds_config(tmp_path, user)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config = _config(str(tmp_path), 2, "adam", deepspeed={"config_json": "/nope.json"})
        from runner.deepspeed_engine import build_ds_config

        build_ds_config(config_from_dict(config), 2)


@pytest.mark.parametrize(
    "section, match",
    [
        ({"zero_stage": 0}, r"deepspeed.zero_stage must be 1, 2 or 3, got 0"),
        ({"zero_stage": 4}, r"deepspeed.zero_stage must be 1, 2 or 3, got 4"),
        (
            {"zero_stage": 2, "offload_param": "cpu"},
            r"offload_param = 'cpu' needs deepspeed.zero_stage = 3",
        ),
        ({"offload_optimizer": "nvme"}, r"deepspeed.offload_optimizer must be none or cpu"),
    ],
)
def test_deepspeed_section_checks(tmp_path, section, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(_config(str(tmp_path), 2, "adam", deepspeed=section))


@pytest.mark.parametrize(
    "sections, match",
    [
        ({"parallelism": {"pp": 2}}, r"parallelism.pp = 2 .*pipeline"),
        ({"parallelism": {"tp": 2}}, r"parallelism.tp = 2 .*tensor parallel"),
        ({"parallelism": {"dp_replicate": 2}}, r"parallelism.dp_replicate = 2"),
        ({"training": {"loss_chunks": 4}}, r"training.loss_chunks = 4 .*ZeRO-3"),
        ({"parallelism": {"cp": 2}}, r"parallelism.cp = 2 .*context parallel"),
        ({"parallelism": {"cpu_offload": True}}, r"cpu_offload = true .*offload_optimizer"),
        (  # was ignored silently: the engine's checkpoint holds every weight
            {"checkpoint": {"trainable_only": True}, "training": {"mode": "engram_only"}},
            r"checkpoint.trainable_only = true is not supported .*every weight",
        ),
        (
            {"parallelism": {"fsdp_reshard_after_forward": "never"}},
            r"fsdp_reshard_after_forward = \"never\" .*stage3_",
        ),
    ],
)
def test_layouts_this_variant_refuses(tmp_path, sections, match):
    from runner.deepspeed_engine import check_layout

    with pytest.raises(ConfigError, match=match):
        check_layout(config_from_dict(_config(str(tmp_path), 2, "adam", **sections)))


def test_every_setting_is_classified_for_deepspeed():
    """A new config setting must be classified in runner/deepspeed_settings.py (honoured,
    refused with a reason, or irrelevant here), as planner/registry.py does for the planner:
    recipes/train_deepspeed.py never ignores one by default."""
    from engram.config import JobConfig
    from runner import deepspeed_settings as ds

    names = set(ds.settings(JobConfig()))
    classes = [set(ds.HONOURED), set(ds.REFUSED), set(ds.IRRELEVANT)]
    unclassified = names - set().union(*classes)
    assert not unclassified, f"classify in runner/deepspeed_settings.py: {unclassified}"
    assert set().union(*classes) <= names, f"stale: {set().union(*classes) - names}"
    assert sum(len(c) for c in classes) == len(names), "a setting in two classes"


def test_missing_deepspeed_names_the_install_command(monkeypatch):
    from runner.deepspeed_engine import import_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[deepspeed\]"'):
        import_deepspeed("cpu")


@pytest.mark.slow
def test_run_train_sh_zero3_trains_and_exports(tmp_path):
    """The README-style command of docs/deepspeed.md on this CPU machine, then the export."""
    env = {
        **os.environ,
        "NGPU": "2",
        "TRAIN_SCRIPT": "recipes/train_deepspeed.py",
        "CONFIG_FILE": "train_configs/debug_model.toml",
        "MASTER_PORT": str(free_port()),
    }
    args = [f"--job.dump_folder={tmp_path}", "--training.steps=6", "--checkpoint.enable=true"]
    proc = subprocess.run(
        [
            "./run_train.sh",
            "--deepspeed.zero_stage=3",
            "--metrics.log_freq=1",
            "--metrics.peak_tflops=2.0",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [
        json.loads(x) for x in (tmp_path / "debug" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    # This recipe logs the throughput keys too; the MFU divides by metrics.peak_tflops.
    for r in (r for r in records if "loss" in r):
        assert r["tflops"] > 0 and r["mfu"] == pytest.approx(100 * r["tflops"] / 2.0), r
        assert {"max_active_gib", "max_reserved_pct", "data_time_s", "data_pct"} <= r.keys()
    step = tmp_path / "debug" / "checkpoint" / "step-6"
    assert (step / "engine" / "model").is_dir() and (step / "manifest.json").is_file()
    out = tmp_path / "hf"
    export = subprocess.run(
        [sys.executable, "scripts/export_hf.py", "--out", str(out), "--job.config_file",
         "train_configs/debug_model.toml", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_shipped_32b_deepspeed_config_builds_its_ds_config():
    from runner.deepspeed_engine import build_ds_config, check_layout

    cfg = load_config([f"--job.config_file={ROOT / 'train_configs/32b_npu_deepspeed.toml'}"])
    check_layout(cfg)
    cwd = os.getcwd()
    os.chdir(ROOT)  # config_json is relative to the repository root, where run_train.sh runs
    try:
        ds = build_ds_config(cfg, world_size=64)
    finally:
        os.chdir(cwd)
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] is True
    assert ds["train_batch_size"] == 2 * 2 * 64 and ds["communication_data_type"] == "fp32"
    assert ds["zero_optimization"]["reduce_bucket_size"] == 50_000_000
