"""DeepSpeed ZeRO-1/2/3 for the dense model; the Engram tables stay outside the engine.

Used by recipes/train_deepspeed.py (docs/deepspeed.md). What lives here, so the recipe holds
only its loop:

- `import_deepspeed`: the optional dependency, with the install command when it is missing;
- `check_layout` (runner/deepspeed_settings.py: every setting classified, the refused ones
  refused by name) / `build_ds_config`: the [deepspeed] section and the TOML turned into a
  ds_config dict, merged with the user's `deepspeed.config_json`; a setting both give must agree;
- `place_for_engine`: the model for the engine (LoRA, table sharding, activation checkpointing,
  training mode, materialisation), the counterpart of parallelize_model;
- `detach_tables`: the row-sharded Engram tables leave the module tree handed to
  `deepspeed.initialize` (ZeRO-3 partitions every parameter of that tree and cannot exclude
  any), and are gathered under their original names in a module of their own (their optimizer,
  their DCP checkpoint);
- `clip_engine_and_tables_`: one global gradient norm over the engine's ZeRO partitions and the
  table shards, and clipping by it (DeepSpeed's own `gradient_clipping` is 0: it sees the
  engine only);
- `EngineCheckpoint`: the engine's own checkpoint as a folder state of CheckpointManager, so it
  is committed with the table shards in one step folder; `convert_to_universal` (the command
  scripts/deepspeed_universal.py) adds DeepSpeed's universal format to a step folder, which
  the engine loads at another world size. Every read of DeepSpeed's files (resume,
  conversion) runs inside engram/checkpoint/deepspeed_folder.py `weights_only_loads`: no pickled
  code runs; reading a step folder into an unsharded model is there too.

The engine gets a torch optimizer through DeepSpeed's client-optimizer path
(`deepspeed.initialize(optimizer=torch.optim.AdamW(...))`, `zero_allow_untested_optimizer`,
`zero_force_ds_cpu_optimizer = false` under offload): no DeepSpeed op is JIT-built.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from engram.checkpoint import CheckpointError, add_to_manifest, read_manifest, verify_checkpoint
from engram.checkpoint.deepspeed_folder import (
    ENGINE_TAG,
    is_deepspeed_step,
    register_at,
    weights_only_loads,
)
from engram.config import Comm, ConfigError, JobConfig
from engram.hf.load import HFLoadPlan, load_hf_backbone, plan_hf_load
from engram.models.table_grad import row_grad, scale_row_grads_
from engram.models.transformer import clean_fqn
from engram.optim.builder import apply_training_mode
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.engram_tables import ShardedEngramTable
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import convert_model, engram_halo, shard_engram_tables
from runner.deepspeed_save import save_bounded
from runner.deepspeed_settings import check_settings as check_layout

INSTALL = 'pip install -e ".[deepspeed]"'
UNIVERSAL_TAG = f"{ENGINE_TAG}_universal"  # <step folder>/engine/model_universal/ (converted)
CONVERT = "python scripts/deepspeed_universal.py"  # convert_to_universal on the command line
logger = logging.getLogger("engram")

__all__ = [
    "EngineCheckpoint",
    "build_ds_config",
    "check_layout",
    "clip_engine_and_tables_",
    "convert_to_universal",
    "detach_tables",
    "engine_grad_norm",
    "engine_update_discarded",
    "import_deepspeed",
    "place_for_engine",
]


def import_deepspeed(device_type: str) -> Any:
    """The deepspeed module, or an ImportError that says how to install it.

    On CPU, DeepSpeed's communication backend would JIT-build its shared-memory all-reduce op
    (minutes of C++ compilation; used only by its inference all-reduce) and probe a compiler for
    every op: its table of compatible ops is set empty first, so training uses gloo's
    collectives and nothing is compiled. Accelerators keep DeepSpeed's defaults."""
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(
            f"recipes/train_deepspeed.py needs DeepSpeed, which is not installed ({e}). "
            f"Install it with: {INSTALL}   (or use recipes/train.py, FSDP2, which does not)"
        ) from e
    if device_type == "cpu":
        deepspeed.ops.__compatible_ops__ = {}
    # DeepSpeed calls torch's older collective names every step; torch warns each time.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`"
    )
    return deepspeed


def _owned_settings(cfg: JobConfig, world_size: int) -> list[tuple[str, Any, str]]:
    """(ds_config key path, value, the TOML setting it comes from) for every key we set."""
    t, d, p = cfg.training, cfg.deepspeed, cfg.parallelism
    bf16 = p.mixed_precision_param == "bfloat16"
    owned = [
        ("train_micro_batch_size_per_gpu", t.local_batch_size,
         f"training.local_batch_size = {t.local_batch_size}"),
        ("gradient_accumulation_steps", t.grad_accum_steps,
         f"training.grad_accum_steps = {t.grad_accum_steps}"),
        ("train_batch_size", t.local_batch_size * t.grad_accum_steps * world_size,
         f"training.local_batch_size x training.grad_accum_steps x {world_size} ranks"),
        ("gradient_clipping", 0.0, f"training.max_norm = {t.max_norm} is applied by the recipe "
         "to the engine and the Engram tables together, so DeepSpeed's own clipping stays 0"),
        ("zero_optimization.stage", d.zero_stage, f"deepspeed.zero_stage = {d.zero_stage}"),
        ("zero_optimization.offload_optimizer.device", d.offload_optimizer,
         f"deepspeed.offload_optimizer = {d.offload_optimizer!r}"),
        ("bf16.enabled", bf16, f"parallelism.mixed_precision_param = {p.mixed_precision_param!r}"),
        ("communication_data_type", "bf16" if p.mixed_precision_reduce == "bfloat16" else "fp32",
         f"parallelism.mixed_precision_reduce = {p.mixed_precision_reduce!r}"),
    ]  # fmt: skip
    if d.zero_stage == 3:
        owned.append(
            ("zero_optimization.offload_param.device", d.offload_param,
             f"deepspeed.offload_param = {d.offload_param!r}")
        )  # fmt: skip
    return owned


def _get(tree: dict, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            user = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"deepspeed.config_json = {path!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"deepspeed.config_json = {path!r} is not a readable JSON file: {e}"
        ) from None
    if not isinstance(user, dict):
        raise ConfigError(f"deepspeed.config_json = {path!r} must hold a JSON object")
    return user


def build_ds_config(cfg: JobConfig, world_size: int) -> dict[str, Any]:
    """The ds_config for `deepspeed.initialize`: the TOML's settings, merged over the user's
    `deepspeed.config_json` (kept for everything the TOML does not set: bucket sizes, overlap,
    prefetch, ...). A key both set to different values is a ConfigError naming both; "auto" (the
    HF convention) takes the TOML's value."""
    src = cfg.deepspeed.config_json
    user = _read_json(src) if src else {}
    if user:
        if _get(user, "fp16.enabled") is True:
            raise ConfigError(
                f"{src} enables fp16: refused. DeepSpeed's fp16 loss scaler would scale the "
                "Engram table gradients it does not own (the tables live outside the engine). "
                "Use bf16: parallelism.mixed_precision_param = 'bfloat16'"
            )
        for section, why in (
            ("optimizer", "[optimizer] in the TOML defines it (a torch optimizer is handed to "
             "the engine)"),
            ("scheduler", "[lr_scheduler] in the TOML defines it (one schedule for the engine "
             "and the tables)"),
        ):  # fmt: skip
            if section in user:
                raise ConfigError(f"{src} has an {section!r} section: remove it; {why}")
    merged = copy.deepcopy(user)
    for path, value, setting in _owned_settings(cfg, world_size):
        theirs = _get(user, path)
        if theirs is not None and theirs != "auto" and theirs != value:
            raise ConfigError(
                f"{src} sets {path} = {json.dumps(theirs)} but the recipe sets "
                f"{json.dumps(value)} ({setting}): make them agree (or drop the key from the JSON)"
            )
        _set(merged, path, value)
    merged.setdefault("zero_allow_untested_optimizer", True)  # a torch optimizer, see above
    merged.setdefault("zero_force_ds_cpu_optimizer", False)  # no JIT-built DeepSpeedCPUAdam
    merged.setdefault("steps_per_print", 2**31 - 1)  # metrics are ours
    if merged["bf16"]["enabled"]:
        merged["bf16"].setdefault("check_grad_overflow", True)  # skip non-finite steps
    return merged


# ----------------------------------------------------------------------------- the tables


def detach_tables(model: nn.Module) -> nn.Module:
    """Take the row-sharded Engram tables out of `model`'s module tree; return a module that
    holds them under their original names (`layers.1.engram.table.weight`, as in train.py's
    checkpoints). Each Engram block keeps a plain attribute reference to its table, so the
    forward is unchanged, while `model.parameters()` / `state_dict()` (and so DeepSpeed) no
    longer see the tables."""
    tables = nn.Module()
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, ShardedEngramTable)]
    for fqn, table in found:
        parent_name, _, attr = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        del parent._modules[attr]
        object.__setattr__(parent, attr, table)  # an attribute, not a registered submodule
        register_at(tables, clean_fqn(fqn), table)  # without activation-checkpoint wrapper names
    return tables


def materialize_into_partitions(
    model: nn.Module,
    tables: nn.Module,
    device: torch.device,
    seed: int,
    ds_config: dict,
    hf: HFLoadPlan | None = None,
) -> None:
    """ZeRO-3: materialise and initialise a meta-built model one top-level block at a time
    (embedding, each decoder layer, final norm, output), load the block's tensors of the HF
    folder when `hf` is given (a checked engram.hf.load.plan_hf_load), and hand the block to
    `deepspeed.zero.Init(module=block)` before the next: the peak is one block plus the
    partitions, not the whole model (131 GB in fp32 at 32B). `tables` (detached, row-sharded)
    are materialised (and loaded) after. The weights equal those of `to_empty` + `init_weights`
    (+ load_hf_backbone): the init is per parameter and layout independent, and meta and
    already-partitioned parameters are skipped by it."""
    import deepspeed

    blocks = [("tok_embeddings", model.tok_embeddings)]
    blocks += [(f"layers.{k}", layer) for k, layer in model.layers.items()]
    blocks.append(("norm", model.norm))
    if not model.args.tie_embeddings:  # tied: the output shares the embedding weight
        blocks.append(("output", model.output))
    bf16 = ds_config["bf16"]["enabled"]
    begin, loaded, read_bytes = time.perf_counter(), 0, 0
    for prefix, block in blocks:
        block.to_empty(device=device)
        model.init_weights(seed=seed, buffer_device=device)
        if hf is not None:
            named = {clean_fqn(n): p for n, p in block.named_parameters(prefix=prefix)}
            n, b = hf.read_into(named)
            loaded, read_bytes = loaded + n, read_bytes + b
        if bf16:  # what deepspeed.initialize does to a whole module (zero.Init does not cast)
            block.bfloat16()
        deepspeed.zero.Init(module=block, config_dict_or_path=ds_config, mem_efficient_linear=False)
    tables.to_empty(device=device)
    model.init_weights(seed=seed, buffer_device=device)  # the tables; the rest is partitioned
    if hf is not None:
        n, b = hf.read_into(dict(tables.named_parameters()))  # names as in the model
        hf.log(loaded + n, read_bytes + b, time.perf_counter() - begin)


def place_for_engine(
    model: nn.Module, cfg: JobConfig, dims: ParallelDims, device: torch.device, ds_config: dict
) -> nn.Module:
    """recipes/train_deepspeed.py's parallelize_model + materialisation: the converters (LoRA
    in lora mode, as train.py's; float8 is refused by check_layout), the tables row-sharded as
    in train.py, activation checkpointing, the training mode; then the weights materialised and
    initialised (+ model.hf_checkpoint) and the tables taken out of the module tree (ZeRO-3
    would partition them): they are returned, `model` is what becomes the engine."""
    dims.check_model(model.args, cfg.training.seq_len, engram_halo(cfg))
    convert_model(model, cfg, dims)
    # EngineStep hands the engine its loss times dp (it averages over dp): the tables, outside
    # the engine, take that factor back.
    shard_engram_tables(model, cfg, dims, grad_scale=1.0 / dims.dp_size)
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    apply_training_mode(model, cfg.training.mode)
    if cfg.deepspeed.zero_stage == 3:  # each block (+ its HF tensors) into its partitions
        hf = cfg.model.hf_checkpoint
        plan = plan_hf_load(model, hf, model.args) if hf else None  # checked before any read
        tables = detach_tables(model)
        materialize_into_partitions(model, tables, device, cfg.job.seed, ds_config, plan)
        return tables
    # ZeRO-1/2 keep whole weights on every rank anyway
    model.to_empty(device=device)
    model.init_weights(seed=cfg.job.seed)
    if cfg.model.hf_checkpoint:  # a resumed run overwrites them with the checkpoint
        load_hf_backbone(model, cfg.model.hf_checkpoint, model.args)
    return detach_tables(model)


# ----------------------------------------------------------------------------- gradients


def engine_grad_norm(engine: Any) -> torch.Tensor:
    """Global L2 norm of the engine's gradients after the last backward of an optimizer step
    (every rank's ZeRO partition counted once): the value DeepSpeed's step computes again for
    its clipping. Collective over the engine's data-parallel group."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        from deepspeed.runtime.utils import combine_grad_norm_groups

        norm = combine_grad_norm_groups(opt._get_norm_groups())
    else:
        norm = opt.scaled_global_norm()
    return norm.float() / float(opt.loss_scale)


def _table_grad_norm_sq(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """Squared gradient norm of the row-sharded tables (dense or row-sparse gradients), each
    shard once: all-reduced over the tables' mesh on every rank, even one without gradients."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            total += g.float().pow(2).sum().to(device)
        rg = row_grad(p)
        if rg is not None:
            total += rg[1].float().pow(2).sum().to(device)
    if params and params[0].device_mesh.size() > 1:
        dist.all_reduce(total, group=params[0].device_mesh.get_group())
    return total


@torch.no_grad()
def clip_engine_and_tables_(
    engine: Any, table_params: list[nn.Parameter], max_norm: float
) -> torch.Tensor:
    """The global gradient norm over the engine and the Engram tables (each element once), and
    clipping of both to `max_norm` (> 0) with train.py's rule: grads x min(1, max_norm / (norm +
    1e-6)). The tables are scaled here; the engine is scaled inside its next `step()`: its clip
    threshold is set so that DeepSpeed's own factor, (engine norm + 1e-6) / threshold, is the
    same global factor. Collective: call on every rank before `engine.step()` at the boundary."""
    engine_norm = engine_grad_norm(engine)
    total = (engine_norm.pow(2) + _table_grad_norm_sq(table_params, engine_norm.device)).sqrt()
    opt = engine.optimizer
    opt.clip_grad = 0.0
    if max_norm > 0 and torch.isfinite(total) and total + 1e-6 > max_norm:
        coef = max_norm / (total + 1e-6)
        for p in table_params:
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                g.mul_(coef.to(g.device))
        scale_row_grads_(table_params, coef)
        opt.clip_grad = float(max_norm * (engine_norm + 1e-6) / (total + 1e-6))
    return total


@contextmanager
def engine_update_discarded(engine: Any) -> Iterator[None]:
    """The engine's `step()` inside this block discards its update as DeepSpeed does on an
    overflow (gradients zeroed, `skipped_steps` + 1, `was_step_applied()` False): its gradient
    norm reads as inf, the sentinel its own overflow check acts on. For a step the recipe's guard
    skips although the engine's gradients are finite (only the tables' are not): without this
    the backbone would update while the tables do not. Call at a boundary step only."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 3:  # combine_grad_norm_groups(_get_norm_groups())
        name, inf = "_get_norm_groups", lambda: [torch.tensor(float("inf"))]
    else:  # stage 1 / 2: scaled_global_norm()
        name, inf = "scaled_global_norm", lambda *a, **k: torch.tensor(float("inf"))
    setattr(opt, name, inf)  # an instance attribute shadows the method for this step only
    try:
        yield
    finally:
        delattr(opt, name)
    if engine.was_step_applied():
        raise RuntimeError(
            "DeepSpeed applied an update the non-finite guard skipped: this DeepSpeed version "
            "no longer discards a step whose gradient norm is inf (pin deepspeed<0.20)"
        )


# ----------------------------------------------------------------------------- checkpoints


def _saved_world_size(folder: Path) -> int | None:
    """Data-parallel ranks that wrote the engine checkpoint in `folder` (its ZeRO optimizer
    files, one per rank), or None when it has none (then DeepSpeed decides)."""
    files = list(folder.glob("*zero_pp_rank_*_optim_states.pt"))
    return len(files) or None


def _universal_listed(step_dir: Path) -> bool:
    """The manifest of `step_dir` lists a universal engine checkpoint (convert_to_universal
    wrote it and added it): a load that verified the manifest verified its files."""
    prefix = f"engine/{UNIVERSAL_TAG}/"
    return any(name.startswith(prefix) for name in read_manifest(step_dir)["files"])


def convert_to_universal(step_dir: Path, workers: int = 1) -> Path:
    """Convert the engine checkpoint of step folder `step_dir` (recipes/train_deepspeed.py,
    written by any number of ranks) into DeepSpeed's universal format with DeepSpeed's own
    converter (deepspeed.checkpoint.ds_to_universal: one process, CPU; fp32 weights and Adam
    moments per parameter), in `<step>/engine/model_universal/`, and list its files in the
    step's manifest so that a resume verifies them. Returns that folder; a second call finds
    it listed and returns at once. A damaged step folder is refused; an unlisted
    `model_universal/` (an interrupted conversion, or ds_to_universal run by hand) is replaced.
    `workers` > 1: DeepSpeed's process pools for extraction and merging."""
    from deepspeed.checkpoint import ds_to_universal

    step_dir = Path(step_dir)
    if not is_deepspeed_step(step_dir):
        raise CheckpointError(
            f"{step_dir} holds no DeepSpeed engine checkpoint (engine/{ENGINE_TAG}/): pass a "
            "step-<N> folder written by recipes/train_deepspeed.py"
        )
    problems = verify_checkpoint(step_dir, collective=False)
    if problems:
        raise CheckpointError(
            "refusing to convert a damaged or incomplete checkpoint:\n  " + "\n  ".join(problems)
        )
    engine = step_dir / "engine"
    out, tmp = engine / UNIVERSAL_TAG, engine / f"{UNIVERSAL_TAG}.tmp"
    if _universal_listed(step_dir):
        return out
    for stale in (out, tmp):
        if stale.exists():
            logger.warning("replacing %s: the manifest of %s does not list it", stale, step_dir)
            shutil.rmtree(stale)
    args = argparse.Namespace(
        input_folder=str(engine / ENGINE_TAG),
        output_folder=str(tmp),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # the version marker ZeRO-1/2 checkpoints of a plain model lack
    )
    with weights_only_loads(step_dir):  # the converter's own torch.load calls (and its workers')
        ds_to_universal.main(args)
    os.rename(tmp, out)
    (engine / "latest_universal").write_text(UNIVERSAL_TAG)  # the converter wrote the tmp name
    names = sorted(str(p.relative_to(step_dir)) for p in out.rglob("*") if p.is_file())
    add_to_manifest(step_dir, [*names, "engine/latest_universal"])
    return out


def _repair_zero3_universal_load(optimizer: Any, folder: Path) -> None:
    """Undo two defects of DeepSpeed 0.19's ZeRO-3 universal load (runtime/zero/stage3.py,
    `load_hp_checkpoint_state_from_checkpoint_dir_stage3`): it gives every param group the
    hyperparameters of group 0 (`optim_sd[...]["param_groups"][0]`: the no-weight-decay groups
    would decay), and it puts one and the same `step` tensor into the state of every sub-group
    (torch's Adam increments it in place once per group and step: wrong bias correction). Each
    group gets its saved values back, as the same-world-size load restores them, and each state
    its own step."""
    with weights_only_loads(folder):
        sd = torch.load(folder / "zero" / "optimizer_state.pt", map_location="cpu")
    saved = sd["optimizer_state_dict"]["param_groups"]
    live = optimizer.optimizer.param_groups
    if len(saved) != len(live):
        raise CheckpointError(
            f"{folder} holds {len(saved)} optimizer param groups, this run's engine has "
            f"{len(live)}: it was written by another model or optimizer configuration"
        )
    for group, want in zip(live, saved, strict=True):
        group.update({k: v for k, v in want.items() if k != "params"})
    for state in optimizer.optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


class EngineCheckpoint:
    """A DeepSpeed engine's checkpoint (module weights, ZeRO-partitioned optimizer state) as a
    folder state of engram.checkpoint.CheckpointManager: written into `<step folder>/engine/`
    (DeepSpeed's layout: `model/` plus `latest`; its zero_to_fp32.py removed, see
    runner/deepspeed_save.py), listed in the step's
    manifest, loaded after the manifest is verified and before the DCP states. At the saving
    world size it loads `model/`; at another one (or with `checkpoint.load_universal` in the
    ds_config JSON) the universal checkpoint `model_universal/` that convert_to_universal
    added, and refuses with the conversion command when there is none."""

    def __init__(self, engine: Any, save_timeout_s: float = Comm().train_timeout_s):
        self.engine, self.save_timeout_s = engine, save_timeout_s

    def save(self, folder: Path) -> None:
        save = partial(self.engine.save_checkpoint, str(folder), tag=ENGINE_TAG, save_latest=True)
        save_bounded(save, folder, self.save_timeout_s)

    def load(self, folder: Path) -> None:
        # The engine's load_universal_checkpoint flag is read by load_checkpoint only (0.19).
        config = self.engine._config
        asked = bool(config.load_universal_checkpoint)
        saved = _saved_world_size(folder / ENGINE_TAG)
        world = dist.get_world_size()
        universal = asked or (saved is not None and saved != world)
        step_dir = folder.parent
        if universal and not _universal_listed(step_dir):
            why = (
                f"was written by {saved} ranks, this run has {world}: ZeRO partitions resume "
                "only at the same world size"
                if not asked
                else 'is asked for in DeepSpeed\'s universal format ({"checkpoint": '
                '{"load_universal": true}} in deepspeed.config_json)'
            )
            unlisted = (
                f" ({folder / UNIVERSAL_TAG} exists but the step's manifest does not list it: "
                "made by ds_to_universal directly, or interrupted; the command replaces it)"
                if (folder / UNIVERSAL_TAG).exists()
                else ""
            )
            raise CheckpointError(
                f"the DeepSpeed engine checkpoint in {step_dir} {why}. Convert it once to "
                "DeepSpeed's universal format with this command (one process, no accelerator; it "
                f"adds the files to the step's manifest){unlisted}, then rerun this run's launch "
                f"command unchanged:\n  {CONVERT} {step_dir}\n"
                "(the Engram tables, in DCP shards, reshard by themselves)"
            )
        tag = UNIVERSAL_TAG if universal else ENGINE_TAG
        if not (folder / tag).is_dir():
            raise CheckpointError(f"{folder / tag} is missing: no DeepSpeed engine checkpoint")
        config.load_universal_checkpoint = universal
        try:
            with weights_only_loads(folder / tag):  # DeepSpeed's torch.load calls too
                path, _ = self.engine.load_checkpoint(
                    str(folder), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
                )
        finally:
            config.load_universal_checkpoint = asked
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load the engine checkpoint {folder / tag}")
        if universal and self.engine.zero_optimization_stage() == 3:
            _repair_zero3_universal_load(self.engine.optimizer, folder / tag)
