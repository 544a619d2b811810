"""DeepSpeed's checkpoint files are read without running pickled code.

One 1-rank launch per ZeRO stage (2 and 3: their universal loaders differ): a 2-step run with
a checkpoint at each step; step 1 converted to DeepSpeed's universal format; a resume from
step 1 (the engine's own files) and one from its universal conversion, each recording every
file torch.load reads. The native resume reproduces step 2 bit for bit. Then each kind of file
a resume read (model states, ZeRO optimizer states, the universal optimizer_state.pt, one
parameter's fp32 / exp_avg / exp_avg_sq / step file) gets a crafted pickle: its own content
plus an object whose unpickling writes a marker file, listed again in the step's manifest (a
forger can rebuild it). The resume must be refused naming the checkpoint, and the marker must
not exist (without weights_only_loads every one of them ran the payload). Export's reader
(zero_to_fp32 + the tables' DCP shards) is checked the same way.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from launcher import run_distributed

from engram.checkpoint import CheckpointError, add_to_manifest
from engram.config import config_from_dict

pytest.importorskip("deepspeed")
from test_parallelisms_deepspeed import _config, _unsharded_model  # noqa: E402

from engram.checkpoint.deepspeed_folder import load_deepspeed_weights, weights_only_loads  # noqa: E402


class _Payload:
    """Unpickling this writes a marker file (stands for arbitrary code)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


@contextlib.contextmanager
def _recorded_loads():
    """The files torch.load reads (DeepSpeed calls it through the module attribute)."""
    real, seen = torch.load, []

    def recording(f, *args, **kwargs):
        seen.append(str(f))
        return real(f, *args, **kwargs)

    torch.load = recording
    try:
        yield seen
    finally:
        torch.load = real


def _kinds(paths: list[str], step_dir: Path) -> list[str]:
    """One file per kind (relative to `step_dir`): per-parameter universal files collapsed."""
    picked: dict[str, str] = {}
    for p in paths:
        rel = str(Path(p).relative_to(step_dir))
        kind = re.sub(r"^(engine/model_universal/zero)/[^/]+/", r"\1/<param>/", rel)
        kind = re.sub(r"rank_\d+", "rank_<r>", kind)
        picked.setdefault(kind, rel)
    return sorted(picked.values())


def _craft(step_dir: Path, rel: str, marker: Path) -> bytes:
    """Replace file `rel` by its content plus the payload, rebuild its manifest entry; return
    the original bytes."""
    f = step_dir / rel
    original = f.read_bytes()
    with weights_only_loads(f):
        content = torch.load(f, map_location="cpu")
    torch.save({"content": content, "payload": _Payload(marker)}, f)
    add_to_manifest(step_dir, [rel])
    return original


def _restore(step_dir: Path, rel: str, original: bytes) -> None:
    (step_dir / rel).write_bytes(original)
    add_to_manifest(step_dir, [rel])


def _resume(raw: dict, universal: bool, root: str) -> dict:
    from recipes.train_deepspeed import train

    raw = json.loads(json.dumps(raw))
    raw["checkpoint"]["load_step"] = 1
    if universal:
        path = Path(root) / "universal.json"
        path.write_text(json.dumps({"checkpoint": {"load_universal": True}}))
        raw["deepspeed"]["config_json"] = str(path)
    result = train(config_from_dict(raw))
    return {"losses": result.losses}


def _stage(root: str, stage: int) -> dict:
    from recipes.train_deepspeed import train
    from runner.deepspeed_engine import convert_to_universal

    raw = _config(
        f"{root}/zero{stage}",
        1,
        "adam",
        deepspeed={"zero_stage": stage},
        checkpoint={"enable": True, "interval": 1, "keep_latest_k": 0},
    )
    raw["training"]["steps"] = 2
    full = train(config_from_dict(raw))
    step1 = Path(f"{root}/zero{stage}/run/checkpoint/step-1")
    convert_to_universal(step1)
    out: dict = {"full": full.losses, "refused": {}, "ran": []}
    reads = []
    for universal in (False, True):
        with _recorded_loads() as seen:
            out["universal" if universal else "native"] = _resume(raw, universal, root)["losses"]
        reads += [p for p in seen if p.startswith(str(step1))]
    out["kinds"] = _kinds(reads, step1)
    marker = Path(root) / f"marker{stage}"
    for rel in out["kinds"]:
        original = _craft(step1, rel, marker)
        try:
            _resume(raw, "model_universal" in rel, root)
            out["refused"][rel] = "loaded"
        except Exception as e:  # unfixed, DeepSpeed fails on the crafted dict after the payload
            out["refused"][rel] = f"{type(e).__name__}: {e}"
        if marker.exists():
            out["ran"].append(rel)
            marker.unlink()
        _restore(step1, rel, original)
    # export / generation's reader: zero_to_fp32's reads, then the tables through dcp_load
    model = _unsharded_model(raw)
    with _recorded_loads() as seen:
        load_deepspeed_weights(model, step1)
    for rel in _kinds([p for p in seen if p.startswith(str(step1))], step1):
        original = _craft(step1, rel, marker)
        try:
            load_deepspeed_weights(model, step1)
            out["ran"].append(f"export read {rel} without refusing")
        except Exception as e:
            if not isinstance(e, CheckpointError) or "not plain data" not in str(e):
                out["ran"].append(f"export: {rel} gave {type(e).__name__}: {e}")
        if marker.exists():
            out["ran"].append(f"export: {rel}")
            marker.unlink()
        _restore(step1, rel, original)
    if stage == 3:
        out["generate"] = _generate_reads_deepspeed(raw, full, root)
    run = Path(f"{root}/zero{stage}/run/checkpoint")
    out["engines"] = sorted(str(p.relative_to(run)) for p in run.glob("step-*/engine/model"))
    out["scripts"] = sorted(str(p.relative_to(run)) for p in run.rglob("zero_to_*.py"))
    shutil.rmtree(f"{root}/zero{stage}")
    return out


def _generate_reads_deepspeed(raw: dict, full, root: str) -> dict:
    """Item 10: generation's weight loader reads the step-2 folder of the run above into exactly
    the trained engine's and tables' weights; without the DeepSpeed reader it is refused naming
    the export; recipes/generate.py on the run generates."""
    from test_parallelisms_deepspeed import _full

    import recipes.generate as generate
    from engram.checkpoint.deepspeed_folder import read_deepspeed_step
    from engram.checkpoint.fingerprint import config_fingerprint
    from engram.config import to_toml
    from engram.inference import build_for_generation, load_weights
    from engram.models.transformer import clean_fqn

    cfg = config_from_dict(raw)
    trained = {clean_fqn(n): _full(p) for n, p in full.engine.module.named_parameters()}
    trained.update({clean_fqn(n): _full(p) for n, p in full.tables.named_parameters()})
    model, tokenizer, hasher = build_for_generation(cfg, cfg.training.seq_len)
    fingerprint = config_fingerprint(cfg, tokenizer, hasher)
    out: dict = {}
    try:
        load_weights(model, cfg, "checkpoint", 2, fingerprint)
    except CheckpointError as e:
        out["refused"] = str(e)
    out["source"] = load_weights(model, cfg, "checkpoint", 2, fingerprint, read_deepspeed_step)
    got = {n: p.detach().numpy() for n, p in model.named_parameters()}
    out["names_equal"] = sorted(got) == sorted(trained)
    out["differ"] = [n for n in trained if not (got[n] == trained[n]).all()]
    toml = Path(root) / "run.toml"
    toml.write_text(to_toml(cfg))
    argv = ["--job.config_file", str(toml), "--prompt", "The", "--max_new_tokens", "4"]
    out["completion"] = generate.main([*argv, "--checkpoint_step", "2"])
    return out


def _both_stages(rank: int, world: int, root: str) -> dict:
    return {stage: _stage(root, stage) for stage in (2, 3)}


@pytest.mark.slow
def test_crafted_deepspeed_files_are_refused_and_run_no_code(tmp_path):
    got = run_distributed(_both_stages, 1, str(tmp_path), timeout=900)[0]
    for stage, out in got.items():
        where = f"ZeRO-{stage}"
        # DeepSpeed's recovery scripts (they unpickle with weights_only off) are never committed.
        assert out["engines"] == ["step-1/engine/model", "step-2/engine/model"], out["engines"]
        assert out["scripts"] == [], f"{where}: {out['scripts']}"
        assert out["native"] == out["full"][1:], f"{where}: native resume not exact"
        torch.testing.assert_close(
            torch.tensor(out["universal"]), torch.tensor(out["full"][1:]), rtol=1e-5, atol=0
        )
        kinds = out["kinds"]
        assert any(k.endswith("model_states.pt") for k in kinds), kinds
        assert any(k.endswith("optim_states.pt") for k in kinds), kinds
        assert any(k.endswith("zero/optimizer_state.pt") for k in kinds), kinds
        for name in ("fp32", "exp_avg", "exp_avg_sq"):
            assert any(k.endswith(f"/{name}.pt") for k in kinds), (name, kinds)
        assert out["ran"] == [], f"{where}: pickled code ran from {out['ran']} ({out['refused']})"
        assert sorted(out["refused"]) == kinds, f"{where}: not refused: {kinds}"
        for rel, msg in out["refused"].items():
            assert msg.startswith("CheckpointError") and "not plain data" in msg, (rel, msg)
            assert "step-1" in msg, msg
    gen = got[3]["generate"]
    refused = gen["refused"]
    assert "written by deepspeed-zero3" in refused and "export_hf.py" in refused, refused
    assert "read_deepspeed_step" in refused, refused
    assert gen["source"].startswith("checkpoint") and gen["source"].endswith("step-2"), gen
    assert gen["names_equal"] and gen["differ"] == [], gen["differ"]
    assert isinstance(gen["completion"], str), gen


class _Odd:
    """A class torch's weights-only unpickler does not allow (no code runs for it)."""


@pytest.mark.parametrize(
    "obj, reason",
    [
        (_Payload(Path("/nonexistent/marker")), "GLOBAL exec was not an allowed global"),
        (_Odd(), "GLOBAL test_parallelisms_deepspeed_files._Odd was not an allowed global"),
    ],
    ids=["code", "class"],
)
def test_refusal_quotes_torchs_reason_not_its_advice(tmp_path, obj, reason):
    """The refusal shows why torch refused the file, not torch's header ("Please file an
    issue ... WeightsUnpickler error:") nor its advice to turn weights_only off."""
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": obj}, path)
    with pytest.raises(CheckpointError) as refused, weights_only_loads(tmp_path):
        torch.load(path)
    msg = str(refused.value)
    assert reason in msg, msg
    for advice in ("Please file an issue", "WeightsUnpickler", "weights_only` set to `False"):
        assert advice not in msg, msg
