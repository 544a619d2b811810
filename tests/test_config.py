"""Config loading, overrides, clear errors, and every shipped config is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from engram.config import ConfigError, config_from_dict, load_config, to_toml
from engram.hashing.ngram import engram_table_rows
from engram.models.builder import build_model
from parallelisms.parallel_dims import ParallelDims

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("train_configs").glob("*.toml"))


def test_there_are_shipped_configs():
    names = {p.name for p in CONFIGS}
    assert {
        "debug_model.toml", "debug_sft.toml", "32b_npu.toml", "32b_gpu.toml", "8b_gpu.toml",
        "32b_npu_sft_lora.toml", "32b_npu_sft_lora_32k.toml",
    } <= names  # fmt: skip


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path):
    first = path.read_text().splitlines()[0]
    assert (
        first.startswith("# ")
        and f"CONFIG_FILE=train_configs/{path.name}" in first
        and "run_train.sh" in first
    )
    cfg = load_config([f"--job.config_file={path}"])
    # The model (with Engram tables at their real size) must build on the meta device.
    rows = engram_table_rows(cfg.engram)
    vocab = cfg.model.vocab_size or 2048
    model = build_model(cfg.model, cfg.engram, vocab, rows, device="meta")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(
        [
            "--training.steps=7",
            "--engram.layer_ids=0,2",
            "--optimizer.lr=0.5",
            "--data.num_workers=2",
        ]
    )
    assert cfg.training.steps == 7 and cfg.engram.layer_ids == [0, 2] and cfg.optimizer.lr == 0.5
    f = tmp_path / "c.toml"
    f.write_text(to_toml(cfg))
    again = load_config([f"--job.config_file={f}"])
    assert again.to_dict() | {"job": None} == cfg.to_dict() | {"job": None}


def test_cli_overrides_toml(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[training]\nsteps = 3\nseq_len = 64\n")
    cfg = load_config(["--job.config_file", str(f), "--training.steps=9"])
    assert (cfg.training.steps, cfg.training.seq_len) == (9, 64)


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"trainig": {"steps": 1}}, "unknown section [trainig]"),
        ({"training": {"stepz": 1}}, "unknown key training.stepz"),
        ({"training": {"steps": "many"}}, "training.steps must be an integer"),
        ({"training": {"steps": 1.5}}, "training.steps must be an integer"),
        ({"training": {"steps": 0}}, "training.steps must be > 0"),
        ({"engram": {"max_ngram": 1, "vocab_size_per_ngram": []}}, "max_ngram must be >= 2"),
        ({"engram": {"vocab_size_per_ngram": [10]}}, "one entry per order"),
        ({"engram": {"vocab_size_per_ngram": [10, 0]}}, "must be > 0"),
        ({"engram": {"n_embed_per_ngram": 30}}, "divisible"),
        ({"engram": {"layer_ids": [1, 1]}}, "duplicates"),
        ({"training": {"mode": "qlora"}}, "full, engram_only, lora"),
        ({"data": {"dataset": "jsonl"}}, "data.path is required"),
        ({"parallelism": {"fsdp_reshard_after_forward": "sometimes"}}, "always, never or default"),
        ({"comm": {"train_timeout_s": 0}}, "comm.train_timeout_s must be > 0"),
        ({"job": {"cpu_affinity": "socket"}}, "job.cpu_affinity must be numa or none"),
        ({"job": {"device": "npu"}, "compile": {"enable": True}}, "triton-lang/triton-ascend#424"),
        ({"data": {"eval_exact_match": 8}}, "data.dataset = 'synthetic_facts' is plain text"),
        (
            {
                "data": {"dataset": "synthetic_chat", "eval_exact_match": 8},
                "parallelism": {"tp": 2},
            },
            "parallelism.tp > 1 splits it: set data.eval_exact_match = 0",
        ),
        (
            {
                "data": {"dataset": "synthetic_chat", "eval_exact_match": 8},
                "engram": {"table_location": "host"},
                "optimizer": {"table_optimizer": "lazy_adam"},
            },
            "run scripts/eval_qa.py on the checkpoint",
        ),  # fmt: skip
        ({"export": {"folder": "out"}}, "set checkpoint.enable = true"),
        ({"export": {"lora": "merged"}}, "training.mode = 'full': remove it"),
        ({"export": {"lora": "fused"}}, "export.lora must be one of peft, merged"),
    ],
)
def test_bad_config_errors_name_the_fix(raw, needle):
    with pytest.raises(ConfigError, match=None) as e:
        config_from_dict(raw)
    assert needle in str(e.value)


def test_global_batch_size_derives_grad_accum_or_names_the_fix():
    """training.global_batch_size: local x grad_accum x dp = global, grad_accum derived; the
    shipped debug config trains 8 sequences per step at 1, 2 and 4 ranks."""
    debug = load_config(["--job.config_file=train_configs/debug_model.toml"])
    for dp, accum in ((1, 4), (2, 2), (4, 1)):
        t = debug.at_dp(dp).training
        assert (t.local_batch_size, t.grad_accum_steps) == (2, accum)
        assert t.local_batch_size * t.grad_accum_steps * dp == t.global_batch_size == 8
    unset = config_from_dict({"training": {"local_batch_size": 4, "grad_accum_steps": 3}})
    assert unset.at_dp(5).training == unset.training  # per-rank batch: the global grows with dp
    cfg = config_from_dict({"training": {"local_batch_size": 2, "global_batch_size": 8}})
    with pytest.raises(ConfigError, match=r"not a multiple of 6.*number of data-parallel ranks"):
        cfg.at_dp(3)
    with pytest.raises(ConfigError, match=r"not a multiple of 16.*local_batch_size in \[1\]"):
        cfg.at_dp(8)
    agreed = config_from_dict(
        {"training": {"local_batch_size": 2, "global_batch_size": 8, "grad_accum_steps": 2}}
    )
    assert agreed.at_dp(2).training.grad_accum_steps == 2
    with pytest.raises(
        ConfigError, match="grad_accum_steps=2 contradicts.*gives grad_accum_steps = 4"
    ):
        agreed.at_dp(1)
    for bad, needle in ((-8, "must be >= 0"), (9, "not a multiple of training.local_batch_size=2")):
        with pytest.raises(ConfigError, match=needle):
            config_from_dict({"training": {"local_batch_size": 2, "global_batch_size": bad}})


def test_compile_on_npu_needs_the_opt_in_and_then_warns():
    refused = {"job": {"device": "npu"}, "compile": {"enable": True}}
    with pytest.raises(ConfigError, match="compile.allow_on_npu = true"):
        config_from_dict(refused)
    allowed = config_from_dict({**refused, "compile": {"enable": True, "allow_on_npu": True}})
    assert "not shown to work on Ascend" in allowed.compile.check_device("npu")
    assert allowed.compile.check_device("cuda") is None  # other devices: nothing to say
    # job.device = auto is checked when it resolves (engram/train/build.py init_process).
    auto = config_from_dict({"compile": {"enable": True}})
    with pytest.raises(ConfigError, match="triton-ascend#424"):
        auto.compile.check_device("npu")


def test_comm_defaults_cover_a_32b_checkpoint_on_64_ranks():
    comm = config_from_dict({}).comm
    # 12 B x 32.8B params (fp32 weights + Adam) through a 200 MB/s shared file system: ~33 min.
    assert min(comm.init_timeout_s, comm.train_timeout_s) >= 12 * 32.8e9 / 200e6


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="--section.key=value"):
        load_config(["--steps=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["--job.config_file=/nonexistent.toml"])


def test_engram_layer_out_of_range():
    cfg = config_from_dict({"engram": {"layer_ids": [99], "vocab_size_per_ngram": [11, 11]}})
    with pytest.raises(ValueError, match="layer"):
        build_model(cfg.model, cfg.engram, 256, {99: 100}, device="meta")


@pytest.mark.parametrize(
    "degrees, world, needle",
    [
        ((2, 3, 1, 1), 4, "do not multiply to the world size"),
        ((3, -1, 1, 1), 4, "not divisible"),
        ((1, -1, 3, 1), 4, "not divisible"),
        ((1, 1, 0, 1), 1, "tp must be >= 1"),
        ((1, -1, 1, 0), 2, "pp must be >= 1"),
        ((1, -1, 1, 3), 4, "not divisible"),
        ((0, -1, 1, 1), 2, "dp_replicate must be >= 1"),
    ],
)
def test_parallel_degrees_are_validated(degrees, world, needle):
    with pytest.raises(ConfigError) as e:
        ParallelDims(*degrees, world_size=world)
    assert needle in str(e.value)


def test_parallel_dims_resolve_rest():
    d = ParallelDims(2, -1, 1, 1, world_size=8)
    assert (d.dp_shard, d.dp_size, d.hsdp_enabled, d.ddp_enabled) == (4, 8, True, False)
    d = ParallelDims(4, 1, 1, 1, world_size=4)
    assert d.ddp_enabled and not d.fsdp_enabled


def test_config_reference_doc_is_current():
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "config_reference", root / "scripts" / "config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (root / "docs" / "config_reference.md").read_text().strip() == module.render().strip(), (
        "docs/config_reference.md is stale: run python scripts/config_reference.py > docs/config_reference.md"
    )


def test_docs_name_no_machine_local_paths():
    """Commands in the docs use placeholders, not this machine's folders or virtual envs."""
    import re

    root = Path(__file__).resolve().parents[1]
    local = re.compile(r"(?<![\w.])/(work|root|home/\w+|tmp/\w+venv)/")
    hits = [
        f"{p.relative_to(root)}:{i}: {line.strip()}"
        for p in sorted([root / "README.md", *(root / "docs").glob("*.md")])
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if local.search(line)
    ]
    assert hits == []
