"""Loading a Hugging Face checkpoint folder into the (possibly FSDP2 / HSDP-sharded) model.

The reference is a debug model initialised with seed A and exported with the adapter's
`to_hf_state_dict` as two safetensors shards + model.safetensors.index.json (HF's layout). A model
initialised with seed B then loads the folder: its backbone must equal seed A's weights exactly
and its Engram parameters must keep seed B's init, at world 1, under FSDP2 over 2 ranks and under
HSDP 2x2.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from launcher import run_distributed
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from engram.config import config_from_dict
from engram.data.tokenizer import load_tokenizer
from engram.hashing.ngram import NgramHasher
from engram.hf.adapter import to_hf_state_dict
from engram.hf.load import INDEX_FILE, HFLoadError, load_hf_backbone
from engram.models.builder import build_model
from engram.models.transformer import Transformer

SEED_A, SEED_B = 11, 22
SEQ = 16


def _raw(name: str = "llama3", engram: bool = True, layout: dict | None = None) -> dict:
    return {
        "model": {"name": name, "flavor": "debug"},
        "engram": {
            "enabled": engram,
            "layer_ids": [1, 3],
            "n_head_per_ngram": 2,
            "vocab_size_per_ngram": [1009, 997],
            "n_embed_per_ngram": 32,
            "init": "identity",
        },
        "parallelism": layout or {},
    }


def _build(raw: dict) -> tuple[Transformer, NgramHasher]:
    """The model on meta, exactly as recipes/train.py builds it."""
    cfg = config_from_dict(raw)
    tokenizer = load_tokenizer("")
    hasher = NgramHasher.from_config(cfg.engram, tokenizer, tokenizer.vocab_size)
    table_rows = hasher.table_rows if cfg.engram.enabled else {}
    model = build_model(
        cfg.model, cfg.engram, tokenizer.vocab_size, table_rows, "meta", max_seq_len=SEQ
    )
    return model, hasher


def _init(raw: dict, seed: int) -> tuple[Transformer, NgramHasher]:
    model, hasher = _build(raw)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model, hasher


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _is_engram(name: str) -> bool:
    return ".engram." in f".{name}"


def export_hf(
    model: Transformer, folder: Path, dtype: torch.dtype | None = None, drop: str = ""
) -> dict[str, torch.Tensor]:
    """The backbone in HF layout: two shards + index json (as `save_pretrained` writes it)."""
    sd = {n: t.detach() for n, t in model.state_dict().items() if not _is_engram(n)}
    hf = to_hf_state_dict(sd, model.args)
    hf = {k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in hf.items() if k != drop}
    names = sorted(hf)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: hf[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    total = sum(v.numel() * v.element_size() for v in hf.values())
    (folder / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return hf


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(HF folder of seed A's backbone, seed A's weights, seed B's weights after loading it)."""
    folder = tmp_path_factory.mktemp("hf") / "llama3-debug"
    source, _ = _init(_raw(), SEED_A)
    export_hf(source, folder)
    target, _ = _init(_raw(), SEED_B)
    load_hf_backbone(target, folder, target.args)
    return folder, _weights(source), _weights(target)


def test_backbone_loaded_engram_keeps_init(reference):
    _, source, loaded = reference
    fresh, _ = _init(_raw(), SEED_B)
    seed_b = _weights(fresh)
    engram = [n for n in loaded if _is_engram(n)]
    assert engram and len(engram) < len(loaded)
    for name, value in loaded.items():
        expected = seed_b[name] if _is_engram(name) else source[name]
        assert torch.equal(value, expected), name
        if not _is_engram(name) and value.numel() > 1 and "norm" not in name:
            assert not torch.equal(value, seed_b[name]), f"{name}: seeds A and B agree"


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_qwen_names_and_bf16_files(tmp_path, name):
    """q/k/v biases (Qwen2) and q/k norms (Qwen3) map; bf16 files are cast to fp32 params."""
    source, _ = _init(_raw(name), SEED_A)
    with torch.no_grad():  # non-trivial biases / norms, so a dropped one would show
        for n, p in source.named_parameters():
            if n.endswith(".bias") or "q_norm" in n or "k_norm" in n:
                p.normal_()
    hf = export_hf(source, tmp_path, dtype=torch.bfloat16)
    target, _ = _init(_raw(name), SEED_B)
    load_hf_backbone(target, tmp_path, target.args)
    src, got = _weights(source), _weights(target)
    for n, value in got.items():
        if not _is_engram(n):
            assert value.dtype == torch.float32
            assert torch.equal(value, src[n].to(torch.bfloat16).float()), n
    key = "model.layers.0.self_attn.q_norm.weight" if name == "qwen3" else (
        "model.layers.0.self_attn.q_proj.bias"
    )  # fmt: skip
    assert key in hf


def test_tied_embeddings_single_file(tmp_path):
    """A tied model: the export has no lm_head.weight; loading fills the one shared tensor.
    Without an index json, the *.safetensors files are scanned."""
    args = _build(_raw(engram=False))[0].args.replace(tie_embeddings=True)
    source = Transformer(args)
    source.init_weights(seed=SEED_A)
    hf = to_hf_state_dict(source.state_dict(), args)
    assert "lm_head.weight" not in hf
    save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp_path / "model.safetensors"))
    target = Transformer(args)
    target.init_weights(seed=SEED_B)
    load_hf_backbone(target, tmp_path, args)
    assert target.output.weight is target.tok_embeddings.weight
    assert torch.equal(target.output.weight, source.tok_embeddings.weight)


def test_identity_init_keeps_the_pretrained_function(reference):
    """With engram.init = identity, the loaded model's logits equal those of the same backbone
    without Engram: fine-tuning starts from the pretrained function."""
    folder = reference[0]
    with_engram, hasher = _init(_raw(), SEED_B)
    load_hf_backbone(with_engram, folder, with_engram.args)
    plain, _ = _init(_raw(engram=False), SEED_B)
    load_hf_backbone(plain, folder, plain.args)
    ids = torch.randint(
        0, with_engram.args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        got = with_engram(ids, hash_ids=hasher.hash_torch(ids))
        want = plain(ids)
    assert torch.equal(got, want)
    # Not vacuous: a paper-init Engram block does change the function.
    raw = _raw()
    raw["engram"]["init"] = "paper"
    paper, _ = _init(raw, SEED_B)
    load_hf_backbone(paper, folder, paper.args)
    with torch.no_grad():
        assert not torch.allclose(paper(ids, hash_ids=hasher.hash_torch(ids)), want)


def _load_sharded(rank: int, world: int, folder: str, layout: dict) -> dict[str, torch.Tensor]:
    from engram.config import Parallelism
    from parallelisms.engram_tables import apply_engram_table_sharding
    from parallelisms.fsdp import apply_fsdp
    from parallelisms.parallel_dims import ParallelDims

    model, _ = _build(_raw())
    dims = ParallelDims(
        dp_replicate=layout["dp_replicate"], dp_shard=layout["dp_shard"], tp=1, pp=1,
        world_size=world,
    )  # fmt: skip
    dims.build_mesh("cpu")
    tables = apply_engram_table_sharding(model, dims.mesh("engram"), grad_scale=1.0 / dims.dp_size)
    apply_fsdp(model, dims, Parallelism(**layout), ignored_params=tables)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED_B)
    emb = model.tok_embeddings.weight
    table = model.layers["1"].engram.table.weight
    assert isinstance(emb, DTensor) and emb.to_local().shape[0] < emb.shape[0]
    assert isinstance(table, DTensor) and table.to_local().shape[0] < table.shape[0]
    load_hf_backbone(model, folder, model.args)
    return _weights(model)


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout",
    [(2, {"dp_replicate": 1, "dp_shard": 2}), (4, {"dp_replicate": 2, "dp_shard": 2})],
    ids=["fsdp2", "hsdp2x2"],
)
def test_sharded_load_equals_single_process(reference, world, layout):
    folder, _, single = reference
    results = run_distributed(_load_sharded, world, str(folder), layout)
    for rank, got in enumerate(results):
        assert sorted(got) == sorted(single)
        for name, value in got.items():
            assert np.array_equal(value, single[name].numpy()), f"rank {rank}: {name}"


def _expect_error(model: Transformer, folder: Path, *fragments: str) -> str:
    with pytest.raises(HFLoadError) as info:
        load_hf_backbone(model, folder, model.args)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


def test_missing_tensor_is_named(tmp_path):
    source, _ = _init(_raw(), SEED_A)
    export_hf(source, tmp_path, drop="model.layers.2.mlp.up_proj.weight")
    target, _ = _init(_raw(), SEED_B)
    before = _weights(target)
    _expect_error(target, tmp_path, "missing", "layers.2.feed_forward.w3.weight", str(tmp_path))
    after = _weights(target)  # nothing was copied before the error
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_wrong_shape_names_parameter_and_shapes(tmp_path):
    source, _ = _init(_raw(), SEED_A)
    hf = export_hf(source, tmp_path)
    file = "model-00001-of-00002.safetensors"
    tensors = load_file(str(tmp_path / file))
    name = next(k for k in tensors if k.endswith("k_proj.weight"))
    tensors[name] = tensors[name][:-8].contiguous()
    save_file(tensors, str(tmp_path / file))
    target, _ = _init(_raw(), SEED_B)
    our = name.replace("model.", "").replace("self_attn.k_proj", "attention.wk")
    _expect_error(
        target, tmp_path, our, str(list(tensors[name].shape)), str(list(hf[name].shape)), file
    )


def test_wrong_family_lists_unexpected_keys(tmp_path):
    """Qwen3 weights (q/k norms) into a Llama model: unexpected keys, named with their file."""
    source, _ = _init(_raw("qwen3"), SEED_A)
    export_hf(source, tmp_path)
    target, _ = _init(_raw("llama3"), SEED_B)
    _expect_error(target, tmp_path, "unexpected", "self_attn.q_norm.weight", ".safetensors")


def test_wrong_flavor_from_config_json(tmp_path):
    source, _ = _init(_raw(), SEED_A)
    export_hf(source, tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 4096, "num_hidden_layers": 32})
    )
    target, _ = _init(_raw(), SEED_B)
    _expect_error(target, tmp_path, "hidden_size = 4096", "model.flavor")


def test_bad_folder(tmp_path):
    target, _ = _init(_raw(), SEED_B)
    _expect_error(target, tmp_path / "nope", "does not exist", "model.hf_checkpoint")
    _expect_error(target, tmp_path, "no *.safetensors")


def test_single_file_beside_an_index_that_does_not_list_it(tmp_path):
    """An export into a folder with an older sharded export: two models mixed, refused."""
    source, _ = _init(_raw(), SEED_A)
    export_hf(source, tmp_path)
    sd = {n: t.detach() for n, t in source.state_dict().items() if not _is_engram(n)}
    save_file(to_hf_state_dict(sd, source.args), str(tmp_path / "model.safetensors"))
    target, _ = _init(_raw(), SEED_B)
    _expect_error(target, tmp_path, "model.safetensors", "does not list", "--overwrite")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


LLAMA31_ROPE = {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip


def test_config_json_numerics_warn(tmp_path):
    """Same shapes, other RoPE base / scaling (transformers 4 and 5 layouts): load_hf_backbone
    loads, with a warning (the recipes' builder refuses it earlier, see test_models_hf_config.py)."""
    source, _ = _init(_raw(), SEED_A)
    export_hf(source, tmp_path)
    args = source.args
    config = {
        "model_type": "llama", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "intermediate_size": args.ffn_dim, "tie_word_embeddings": False,
        "rope_theta": args.rope_theta, "rms_norm_eps": args.norm_eps, "rope_scaling": None,
    }  # fmt: skip
    v5 = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    records = _Records()
    log = logging.getLogger("engram")
    log.addHandler(records)
    try:
        for changes, warned in [
            ({}, []),
            ({"rope_theta": 10000.0}, ["rope_theta"]),
            ({"rope_scaling": {"rope_type": "llama3", **LLAMA31_ROPE}}, ["rope_scaling"]),
            # transformers 5: both under rope_parameters (not read before: no warning at all).
            (
                {"rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta}},
                [],
            ),
            (
                {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, **LLAMA31_ROPE}},
                ["rope_theta", "rope_scaling"],
            ),
        ]:
            records.messages.clear()
            base = v5 if "rope_parameters" in changes else config
            (tmp_path / "config.json").write_text(json.dumps({**base, **changes}))
            target, _ = _init(_raw(), SEED_B)
            load_hf_backbone(target, tmp_path, target.args)
            numerics = [m for m in records.messages if "checksums.sha256" not in m]
            assert [m.split(" = ")[0].rsplit(" ", 1)[-1] for m in numerics] == warned
    finally:
        log.removeHandler(records)


def test_generate_recipe_uses_hf_folder(reference, tmp_path):
    """recipes/generate.py without a run checkpoint takes model.hf_checkpoint."""
    from engram.inference import build_for_generation, load_weights

    folder, source, _ = reference
    raw = _raw()
    raw["job"] = {"dump_folder": str(tmp_path), "device": "cpu", "seed": SEED_B}
    raw["model"]["hf_checkpoint"] = str(folder)
    cfg = config_from_dict(raw)
    model, _, _ = build_for_generation(cfg, SEQ)
    assert load_weights(model, cfg) == f"HF checkpoint {folder}"
    for name, value in model.named_parameters():
        if not _is_engram(name):
            assert torch.equal(value, source[name]), name


def _train_weights(rank: int, world: int, raw: dict) -> dict:
    from recipes.train import train

    model = train(config_from_dict(raw)).model
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


@pytest.mark.slow
def test_train_starts_from_hf_backbone(tmp_path):
    """recipes/train.py with [model] hf_checkpoint at world 2 (FSDP2), engram_only: the frozen
    backbone is exactly the HF weights after training; Engram params trained from their init."""
    source, _ = _init(_raw(), SEED_A)
    export_hf(source, tmp_path / "hf")
    raw = _raw(layout={"dp_shard": 2})
    raw["model"]["hf_checkpoint"] = str(tmp_path / "hf")
    raw["job"] = {"dump_folder": str(tmp_path), "device": "cpu", "seed": SEED_B}
    raw["training"] = {"mode": "engram_only", "seq_len": 16, "local_batch_size": 2, "steps": 2}
    raw["data"] = {"synthetic_num_entities": 32}
    raw["metrics"] = {"enable_tensorboard": False}
    got, want = run_distributed(_train_weights, 2, raw)[0], _weights(source)
    backbone = [n for n in got if not _is_engram(n)]
    assert backbone and len(backbone) < len(got)
    for n in backbone:
        assert np.array_equal(got[n], want[n].numpy()), n
