"""LoRA mode (training.mode = "lora"): adapters on the frozen backbone, Engram trainable.

- parity: FSDP2, TP2, PP2, FSDP2 x TP2 with activation checkpointing and FSDP2 with compile
  (aot_eager) reproduce the single-process
  lora run (tests/test_parallelisms_parity.py's criteria: losses 1e-5, step-1 grad norm 1e-6, updates 0.3%,
  frozen weights bit-identical);
- the single-process run changes only adapters and Engram parameters, and every lora_B;
- zero-initialised B (and Engram's identity init) leave the backbone's logits exactly unchanged;
- the frozen backbone is held in the compute dtype under FSDP (bf16), adapters in fp32;
- bad settings are refused by name;
- lora.init_a = "peft" draws A from PEFT's default distribution (the default is unchanged).
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
from launcher import run_distributed, run_isolated
from shared_runs import shared_run
from test_parallelisms_parity import GLOBAL_BATCH, _assert_matches, _config, _with
from torch.distributed.tensor import DTensor

from engram.config import ConfigError, config_from_dict, load_config
from engram.data.tokenizer import load_tokenizer
from engram.models.builder import build_from_config
from engram.models.lora import LoRAMixin, is_lora_param
from engram.models.transformer import clean_fqn
from engram.optim.builder import apply_training_mode
from parallelisms.lora import apply_lora

# Two steps, as tests/test_parallelisms_tp.py: TP's different fp32 summation order in the forward drifts the
# loss by ~1e-5 relative from step 3 on (measured 7.5584 vs 7.5585 at lora TP2); step 1 trains B
# and Engram (A's gradient is 0 while B = 0), step 2 all adapters.
STEPS = 2
LORA = {"training": {"mode": "lora"}, "lora": {"rank": 4, "alpha": 8.0}}


def _raw(folder, world: int, layout: dict, extra: dict) -> dict:
    raw = _with(_config(str(folder), world, "lora", layout), _with(LORA, extra))
    dp = world // layout.get("pp", 1) // layout.get("tp", 1)
    raw["training"]["local_batch_size"] = GLOBAL_BATCH // dp
    raw["training"]["steps"] = STEPS
    return raw


def _train(rank: int, world: int, raw: dict) -> dict:
    from recipes.train import train

    result = train(config_from_dict(raw))
    weights, dtypes = {}, {}
    for part in result.model_parts:  # union over the pipeline ranks is taken by the test
        for name, p in part.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            weights[clean_fqn(name)] = full.detach().float().clone()
            dtypes[clean_fqn(name)] = str(p.dtype)
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "weights": weights,
        "dtypes": dtypes,
    }


def _built(raw: dict, lora: bool = True):
    cfg = config_from_dict(raw)
    model, _ = build_from_config(cfg, load_tokenizer(""))
    if lora:
        apply_lora(model, cfg.lora)
    model.to_empty(device="cpu")
    model.init_weights(seed=cfg.job.seed)
    return model, cfg


def _initial_weights(raw: dict) -> dict[str, np.ndarray]:
    model, _ = _built(raw)
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


LAYOUTS = {
    "fsdp2": (2, {"dp_shard": 2}, {}),
    "tp2": (2, {"tp": 2, "dp_shard": 1}, {}),
    "pp2": (2, {"pp": 2}, {"pipeline": {"schedule": "1F1B"}}),
    "fsdp2_x_tp2_ac": (4, {"tp": 2, "dp_shard": 2}, {"activation_checkpoint": {"mode": "full"}}),
    # aot_eager: dynamo + AOT autograd trace the LoRA blocks without generating code (see
    # tests/test_parallelisms_compile.py for why inductor runs only there). Plain linears without TP take
    # the fused LoRA Function (as 1 rank, fsdp2 and pp2): here under AC and compile too.
    "fsdp2_compile_ac": (
        2,
        {"dp_shard": 2},
        {
            "compile": {"enable": True, "backend": "aot_eager"},
            "activation_checkpoint": {"mode": "full"},
        },
    ),
}


@pytest.mark.slow
def test_lora_layouts_match_single_process(tmp_path):
    ref_raw = _raw(tmp_path / "ref", 1, {}, {})
    ref = shared_run(_train, 1, ref_raw)[0]
    init = _initial_weights(ref_raw)
    assert ref["losses"][-1] < ref["losses"][0], "reference lora run did not learn"
    changed = {n for n, w in ref["weights"].items() if not np.array_equal(w, init[n])}
    trainable = {n for n in init if is_lora_param(n) or ".engram." in f".{n}"}
    assert changed <= trainable, f"frozen weights changed: {sorted(changed - trainable)}"
    lora_b = {n for n in init if n.endswith("lora_B")}
    assert lora_b and lora_b <= changed, "some lora_B did not train"
    assert any(".engram." in n for n in changed), "Engram did not train"
    for label, (world, layout, extra) in LAYOUTS.items():
        out = run_distributed(_train, world, _raw(tmp_path / label, world, layout, extra))
        merged = {k: v for o in out for k, v in o["weights"].items()}
        for rank, got in enumerate(out):
            _assert_matches({**got, "weights": merged}, ref, init, f"lora {label} rank {rank}")


def test_zero_b_keeps_the_backbone_logits_exactly(tmp_path):
    """Adapters (B = 0) + Engram (identity init) give the plain backbone's logits bit for bit;
    LoRA also wraps float8 linears (emulated) with the same guarantee."""
    raw = _raw(tmp_path, 1, {}, {"engram": {"init": "identity"}})
    plain_raw = {**raw, "engram": {"enabled": False}, "training": {"mode": "full"}}
    plain_raw.pop("lora")
    plain, _ = _built(plain_raw, lora=False)
    model, cfg = _built(raw)
    assert sum(isinstance(m, LoRAMixin) for m in model.modules()) == 4 * 7
    ids = torch.randint(0, model.args.vocab_size, (2, 32))
    hash_ids = torch.randint(0, 900, (2, 32, 2, cfg.engram.num_heads))
    with torch.no_grad():
        assert torch.equal(model(ids, hash_ids=hash_ids), plain(ids))
        # A nonzero B changes the function (the check above is not vacuous).
        model.layers["1"].attention.wq.lora_B.fill_(0.01)
        assert not torch.equal(model(ids, hash_ids=hash_ids), plain(ids))

    pytest.importorskip("torchao")
    from parallelisms.float8 import apply_float8

    f8_raw = _with(plain_raw, {"float8": {"enable": True, "emulate": True}})
    cfg8 = config_from_dict(f8_raw)
    models = []
    for lora in (False, True):
        m, _ = build_from_config(cfg8, load_tokenizer(""))
        apply_float8(m, cfg8.float8, "cpu", compiled=False)
        if lora:
            apply_lora(m, cfg.lora)
        m.to_empty(device="cpu")
        m.init_weights(seed=cfg8.job.seed)
        models.append(m)
    names = {type(m).__name__ for m in models[1].modules()}
    assert "LoRAFloat8Linear" in names, names
    with torch.no_grad():
        assert torch.equal(models[0](ids), models[1](ids))


def _frozen_dtypes(rank: int, world: int, raw: dict) -> dict:
    out = _train(rank, world, raw)
    return {"dtypes": out["dtypes"], "losses": out["losses"]}


@pytest.mark.slow
def test_frozen_backbone_held_in_compute_dtype(tmp_path):
    """Under FSDP2 with bf16 compute the frozen backbone is stored in bf16 (no fp32 copy), the
    adapters and Engram stay fp32, and the run still learns; lora.frozen_dtype = float32 keeps
    the backbone fp32."""
    layout = {"dp_shard": 2, "mixed_precision_param": "bfloat16"}
    out = run_distributed(_frozen_dtypes, 2, _raw(tmp_path / "bf16", 2, layout, {}))[0]
    for name, dtype in out["dtypes"].items():
        trains = is_lora_param(name) or ".engram." in f".{name}"
        assert dtype == ("torch.float32" if trains else "torch.bfloat16"), (name, dtype)
    assert all(math.isfinite(x) for x in out["losses"]) and out["losses"][-1] < out["losses"][0]
    keep = _raw(tmp_path / "fp32", 2, layout, {"lora": {"frozen_dtype": "float32"}})
    out = run_distributed(_frozen_dtypes, 2, keep)[0]
    assert set(out["dtypes"].values()) == {"torch.float32"}


def test_training_mode_freezes_all_but_adapters_and_engram(tmp_path):
    model, _ = _built(_raw(tmp_path, 1, {}, {}))
    apply_training_mode(model, "lora")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        n for n, _ in model.named_parameters() if is_lora_param(n) or ".engram." in f".{n}"
    }
    assert any(is_lora_param(n) for n in trainable)


@pytest.mark.parametrize(
    "lora, needle",
    [
        ({"rank": 0}, "lora.rank must be >= 1"),
        ({"alpha": float("nan")}, "lora.alpha must be a finite number"),
        ({"alpha": float("inf")}, "lora.alpha must be a finite number"),
        ({"dropout": 1.0}, r"lora.dropout must be in \[0, 1\)"),
        ({"dropout": -0.1}, r"lora.dropout must be in \[0, 1\)"),
        ({"target_modules": ["q_proj", "wq"]}, "match no module; valid names: q_proj, k_proj"),
        ({"target_modules": []}, "at least one projection"),
        ({"frozen_dtype": "fp16"}, "lora.frozen_dtype must be compute or float32"),
        ({"init_a": "kaiming"}, "lora.init_a must be normal or peft"),
    ],
)
def test_bad_lora_settings_name_the_setting(lora, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_dict({"training": {"mode": "lora"}, "lora": lora})


def test_lora_settings_with_another_mode_are_refused(tmp_path):
    """Refused, not warned: the adapters would not exist and the settings would do nothing.
    Default values pass (a config written by to_toml carries the whole [lora] section)."""
    with pytest.raises(
        ConfigError, match="lora.rank set but training.mode = .full. builds no adapters"
    ):
        config_from_dict({"lora": {"rank": 4}})
    with pytest.raises(ConfigError, match="training.mode = 'engram_only' builds no adapters"):
        load_config(["--training.mode=engram_only", "--lora.rank=4"])
    assert load_config(["--training.mode=lora", "--lora.rank=8"]).lora.rank == 8
    with pytest.raises(ConfigError, match="trainable_only = true with training.mode = 'full'"):
        config_from_dict({"checkpoint": {"trainable_only": True}})


def _lora_linear(bias: bool, dropout: float = 0.0) -> torch.nn.Linear:
    from engram.models.lora import add_lora

    torch.manual_seed(0)
    linear = add_lora(torch.nn.Linear(24, 40, bias=bias), rank=4, alpha=8.0, dropout=dropout)
    torch.nn.init.normal_(linear.lora_A)
    torch.nn.init.normal_(linear.lora_B)  # non-zero B: every gradient path is exercised
    return linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_grad", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_fused_lora_linear_matches_the_generic_path(bias, x_grad, frozen):
    """The fused autograd Function (plain nn.Linear base, plain tensors) gives the generic
    path's output and every gradient (fp32 noise: addmm_ sums in another order)."""
    linear = _lora_linear(bias)
    linear.weight.requires_grad_(not frozen)
    if bias:
        linear.bias.requires_grad_(not frozen)
    x = torch.randn(3, 5, 24, requires_grad=x_grad)
    grad_out = torch.randn(3, 5, 40)
    results = []
    for fused in (True, False):
        linear._fusable = lambda fused=fused: fused  # the only switch between the two paths
        y = linear(x)
        assert ("_FusedLoRALinear" in type(y.grad_fn).__name__) == fused
        params = [p for p in linear.parameters() if p.requires_grad]
        inputs = params + ([x] if x_grad else [])
        results.append([y.detach(), *torch.autograd.grad(y, inputs, grad_out)])
    del linear._fusable
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fused_path_is_taken_only_where_it_is_exact():
    linear = _lora_linear(bias=False)
    assert linear._fusable()
    with_dropout = _lora_linear(bias=False, dropout=0.1)
    assert not with_dropout._fusable()
    assert with_dropout.eval()._fusable()  # dropout is the identity in eval
    from torchao.float8.float8_linear import Float8Linear

    from engram.models.lora import add_lora

    f8 = Float8Linear.from_float(torch.nn.Linear(32, 32))
    assert not add_lora(f8, rank=4, alpha=8.0, dropout=0.0)._fusable()  # keeps float8's forward


def _peft_lora_a(in_features: int, rank: int) -> np.ndarray:
    """A of PEFT's default init (LoraConfig(init_lora_weights=True)) on a plain linear."""
    import peft

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(in_features, 64)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    config = peft.LoraConfig(r=rank, target_modules=["proj"], init_lora_weights=True)
    model = peft.get_peft_model(Net(), config)
    return model.base_model.model.proj.lora_A["default"].weight.detach().numpy()


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    grid = np.sort(np.concatenate([a, b]))
    cdf = [np.searchsorted(np.sort(x), grid, side="right") / x.size for x in (a, b)]
    return float(np.abs(cdf[0] - cdf[1]).max())


@pytest.mark.skipif(
    importlib.util.find_spec("peft") is None,
    reason="peft is not installed: pip install -e '.[dev]'",
)
def test_init_a_peft_draws_from_pefts_default_distribution(tmp_path):
    """lora.init_a = "peft" gives A PEFT's distribution, U(-1/sqrt(in), 1/sqrt(in)); not PEFT's
    values (it draws from the global RNG in module-creation order, ours is layout-independent
    per (seed, name)). The default "normal" stays this repo's N(0, 1/in), bit for bit."""
    from engram.models.init import chunk_seed
    from engram.models.lora import add_lora

    in_features, rank, key = 768, 16, "layers.0.feed_forward.w2"
    theirs = run_isolated(_peft_lora_a, in_features, rank).ravel()  # peft imports transformers

    def ours(init_a: str) -> np.ndarray:
        linear = add_lora(torch.nn.Linear(in_features, 64), rank, 8.0, 0.0, init_a=init_a)
        linear.init_lora(seed=0, fqn=key)
        assert not linear.lora_B.any()
        return linear.lora_A.detach().numpy().ravel()

    peft_like, normal = ours("peft"), ours("normal")
    bound = 1 / math.sqrt(in_features)
    for a in (theirs, peft_like):
        assert bound * 0.999 < np.abs(a).max() <= bound
    # 12288 samples each: the KS statistic's 0.1% critical value is 0.025
    assert _ks(peft_like, theirs) < 0.025, _ks(peft_like, theirs)
    assert _ks(normal, theirs) > 0.1  # the test tells the two inits apart
    gen = torch.Generator().manual_seed(chunk_seed(0, f"{key}.lora_A", 0))
    expected = torch.randn(rank * in_features, generator=gen) * bound
    np.testing.assert_array_equal(normal, expected.numpy())
    model, _ = _built(_raw(tmp_path, 1, {}, {"lora": {"init_a": "peft"}}))  # the config reaches A
    adapters = [m for m in model.modules() if isinstance(m, LoRAMixin)]
    assert adapters and all(
        m.lora_A.abs().max() <= 1 / math.sqrt(m.in_features) < m.lora_A.std() * 2 for m in adapters
    )


def test_inference_build_carries_the_training_adapters(tmp_path):
    """build_for_inference (generation, export) adds the adapters the training recipe adds, with
    every setting of lora: the same modules, rank, scaling and init_a, so the same weights."""
    from engram.models.builder import build_for_inference
    from engram.models.lora import lora_targets

    extra = {"lora": {"init_a": "peft", "rank": 2, "target_modules": ["q_proj", "down_proj"]}}
    trained, cfg = _built(_raw(tmp_path, 1, {}, extra))
    served, _ = build_for_inference(cfg, load_tokenizer(""), cfg.training.seq_len)
    adapters = {n: m for n, m in served.named_modules() if isinstance(m, LoRAMixin)}
    assert sorted(adapters) == sorted(n for n, _ in lora_targets(served, cfg.lora))
    assert {n.rsplit(".", 1)[-1] for n in adapters} == {"wq", "w2"}
    for name, module in trained.named_modules():
        if isinstance(module, LoRAMixin):
            theirs = adapters.pop(name)
            assert (theirs.lora_rank, theirs.lora_scaling, theirs.lora_init_a) == (2, 4.0, "peft")
            assert (module.lora_rank, module.lora_scaling, module.lora_init_a) == (2, 4.0, "peft")
    assert not adapters
    served_params = dict(served.named_parameters())
    for name, p in trained.named_parameters():
        torch.testing.assert_close(served_params[name], p, rtol=0, atol=0, msg=name)


def test_lora_target_names_are_the_hf_module_names_of_their_paths():
    """lora.target_modules are HF names (what a PEFT export's target_modules lists) and
    LORA_TARGETS maps them to our paths; the export names each adapter by engram.hf.adapter's
    own mapping of that path. The two must name the same module."""
    from engram.config import LORA_TARGETS
    from engram.hf.adapter import hf_module_name

    for hf_name, path in LORA_TARGETS.items():
        assert hf_module_name(f"layers.3.{path}").split(".")[-1] == hf_name, path
        assert hf_module_name(f"layers.3.{path}").startswith("model.layers.3."), path
