"""The small debug job that several training tests share (one definition)."""

from __future__ import annotations


def small_job(
    tmp: str, name: str, world: int, steps: int, extra: dict, parallelism: dict | None = None
) -> dict:
    """Raw config: debug llama3 + one small Engram layer, global batch 8 x 32 over `world` FSDP
    ranks, lr 1e-3; `extra` is merged per section. `parallelism` replaces the [parallelism]
    section (FSDP over `world`) instead of being merged into it: a layout names its own axes."""
    raw = {
        "job": {"dump_folder": tmp, "run_name": name, "device": "cpu", "seed": 3},
        "model": {"name": "llama3", "flavor": "debug"},
        "engram": {
            "layer_ids": [1],
            "n_head_per_ngram": 2,
            "vocab_size_per_ngram": [1009, 997],
            "n_embed_per_ngram": 32,
            "init": "paper",
        },
        "training": {"seq_len": 32, "local_batch_size": 8 // world, "steps": steps},
        "data": {"synthetic_num_entities": 64},
        "optimizer": {"lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 2},
        "metrics": {"log_freq": 100, "enable_tensorboard": False},
        "parallelism": {"dp_shard": world} if parallelism is None else dict(parallelism),
    }
    for section, values in extra.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


DEBUG_CONFIG = "train_configs/debug_model.toml"


def load_shipped(path: str, *overrides: str):
    """load_config of a shipped config file with overrides. The debug config comes with a
    per-rank batch of 8 sequences (global_batch_size 0): its file fixes the global batch
    instead (8 at any world size), and the planner tests' per-rank counts are written for a
    per-rank batch that any world size takes."""
    from engram.config import load_config

    per_rank = ("--training.global_batch_size=0", "--training.local_batch_size=8")
    first = per_rank if path == DEBUG_CONFIG else ()
    return load_config(["--job.config_file", path, *first, *overrides])
