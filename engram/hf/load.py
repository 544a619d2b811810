"""Initialise the backbone from a Hugging Face checkpoint folder, after parallelisation.

    load_hf_backbone(model, "/models/Qwen2.5-32B", model.args)

Call it after `to_empty()` + `init_weights()`: parameters may then be FSDP2 / HSDP DTensors
(Shard(0) on a 1-D or 2-D mesh), row-sharded Engram tables, or plain tensors at world size 1.
Each rank reads only the block of every tensor that it holds (safetensors slices of a memory-mapped
file), so a 32B checkpoint is never materialised in full on any rank. Names are mapped by
engram/hf/adapter.py (Llama / Qwen2 / Qwen3). Engram parameters are not part of an HF
checkpoint and keep their init; a folder that does carry them (engram/hf/export.py's
`model.layers.<i>.engram.*`, or the adapter's `engram.` prefix) loads them too. Values are cast to the parameter dtype. A tied model (one Parameter for
the embedding and the head) takes model.embed_tokens.weight and needs no lm_head.weight.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from engram.config import JobConfig
from engram.hf.adapter import from_hf_state_dict
from engram.hf.checksums import verify_folder
from engram.hf.export import ENGRAM_FILE
from engram.hf.hash_params import check_hash_params
from engram.models.args import ModelArgs
from engram.models.engram import is_engram_param
from engram.models.hf_config import CONFIG_FILE, HFConfigError, args_from_hf_config, read_hf_config
from engram.models.init import local_view
from engram.models.lora import is_lora_param
from engram.models.transformer import clean_fqn
from engram.rowstore.host_worker import row_store_of

logger = logging.getLogger("engram")

INDEX_FILE = "model.safetensors.index.json"
# config.json field -> ModelArgs field; a mismatch means another architecture (or flavor).
_CONFIG_SHAPE = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "ffn_dim",
    "head_dim": "head_dim",
    "tie_word_embeddings": "tie_embeddings",
}
# Numerics that do not change any shape: a mismatch is legal (e.g. an Instruct variant) but
# worth a warning, since nothing else would catch it.
_CONFIG_NUMERIC = {
    "rope_theta": "rope_theta",
    "rms_norm_eps": "norm_eps",
    "rope_scaling": "rope_scaling",
}
_MAX_LISTED = 20


class HFLoadError(ValueError):
    """The HF folder does not fit this model; the message says what differs and how to fix it."""


def load_hf_backbone(model: nn.Module, hf_dir: str | Path, model_args: ModelArgs) -> None:
    """Copy the HF checkpoint in `hf_dir` into `model`'s (local shards of) backbone parameters.

    Every backbone parameter must be in the folder and every tensor in the folder must map to a
    parameter (else HFLoadError listing them); global shapes must match (else HFLoadError naming
    the parameter and both shapes). Nothing is copied unless all checks pass. Not collective:
    each rank reads its own slices.
    """
    begin = time.perf_counter()
    plan = plan_hf_load(model, hf_dir, model_args)
    n, read_bytes = plan.read_into(_parameters(model))
    plan.log(n, read_bytes, time.perf_counter() - begin)


@dataclass
class HFLoadPlan:
    """A checked HF load (plan_hf_load): which folder tensor goes to which parameter name."""

    folder: Path
    entries: dict[str, tuple[str, str]]  # our parameter name -> (HF name, file)
    kept: int  # parameters not in the folder (Engram / LoRA): they keep their init

    def read_into(self, params: dict[str, torch.Tensor]) -> tuple[int, int]:
        """Copy the planned tensors of `params` (our name -> materialised parameter; any subset
        of the model, e.g. one block at a time) into their local shards; returns (tensors,
        bytes read)."""
        by_file: dict[str, list[tuple[str, str]]] = {}
        for ours, (hf_name, file) in self.entries.items():
            if ours in params:
                by_file.setdefault(file, []).append((ours, hf_name))
        n = read_bytes = 0
        with torch.no_grad():
            for file, pairs in sorted(by_file.items()):
                with safe_open(self.folder / file, framework="pt", device="cpu") as f:
                    for ours, hf_name in pairs:
                        n += 1
                        local, offset = _local_shard(params[ours])
                        if local.numel() == 0:  # an uneven split can leave a rank without rows
                            continue
                        if local.dim() == 0:
                            block = f.get_tensor(hf_name)
                        else:
                            index = tuple(
                                slice(o, o + s) for o, s in zip(offset, local.shape, strict=True)
                            )
                            block = f.get_slice(hf_name)[index]
                        store = row_store_of(params[ours])
                        if store is not None:  # an NVMe table: its rows live in the store
                            store.load({"weight": block.to(torch.float32)})
                        else:
                            local.copy_(block)  # casts to the parameter dtype and device
                        read_bytes += block.numel() * block.element_size()
        return n, read_bytes

    def log(self, n: int, read_bytes: int, seconds: float) -> None:
        logger.info(
            "loaded %d tensors from %s (%.2f GiB read on this rank) in %.1f s; %d Engram "
            "/ LoRA parameters keep their init",
            n, self.folder, read_bytes / 2**30, seconds, self.kept,
        )  # fmt: skip


def plan_hf_load(model: nn.Module, hf_dir: str | Path, model_args: ModelArgs) -> HFLoadPlan:
    """Every check of load_hf_backbone (names, shapes, config.json), reading no tensor data; the
    model may still be on the meta device (its global shapes are known), so a caller that
    materialises it block by block (DeepSpeed ZeRO-3) can check first and read per block."""
    folder = Path(hf_dir)
    key_files = _tensor_files(folder)
    _check_hf_config(folder, model_args)
    _check_engram_config(folder, getattr(model, "engram_cfg", None))
    params = _parameters(model, allow_meta=True)
    plan = _plan(folder, key_files, params, model_args, _other_stage(model))
    _check_shapes(folder, plan, params)
    return HFLoadPlan(folder, plan, kept=len(set(params) - set(plan)))


def load_frozen_backbone(model: nn.Module, cfg: JobConfig) -> bool:
    """checkpoint.trainable_only: read the frozen backbone, which such a checkpoint does not hold,
    from model.hf_checkpoint into `model` (call before reading the checkpoint). Returns whether
    it read anything (without an HF folder the backbone is the job.seed init)."""
    if not (cfg.checkpoint.trainable_only and cfg.model.hf_checkpoint):
        return False
    load_hf_backbone(model, cfg.model.hf_checkpoint, model.args)
    return True


def load_hf_at_start(
    model_parts: list[nn.Module], cfg: JobConfig, start_step: int, frozen_read: bool
) -> None:
    """model.hf_checkpoint into a fresh run's backbone, after the checkpoint load (under PP each
    stage reads its own layers). Nothing for a resumed run (its checkpoint has the weights) nor
    when load_frozen_backbone (`frozen_read`) read the folder already."""
    if not cfg.model.hf_checkpoint or start_step != 0:
        return
    if cfg.engram.enabled and cfg.engram.init != "identity":
        logger.warning("engram.init is not 'identity': the pretrained function changes at step 0")
    for part in model_parts if not frozen_read else ():
        load_hf_backbone(part, cfg.model.hf_checkpoint, model_parts[0].args)


# ----------------------------------------------------------------------------- folder


def _tensor_files(folder: Path) -> dict[str, str]:
    """HF tensor name -> safetensors file name (relative to `folder`)."""
    if not folder.is_dir():
        raise HFLoadError(
            f"HF checkpoint folder {folder} does not exist: set model.hf_checkpoint to the folder "
            "that holds config.json and *.safetensors (e.g. a `huggingface-cli download` target)"
        )
    # An export's checksums.sha256 (a download has none: a warning). Hashing reads every file,
    # so one process per node does it (the node's ranks read the same copy); when it refuses,
    # the launcher (torchrun, srun --kill-on-bad-exit) stops the node's other ranks.
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        verify_folder(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFLoadError(f"{index} has no 'weight_map': the index file is damaged")
        absent = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if absent:
            raise HFLoadError(
                f"{index} names shard files that are not in {folder}: {absent}. The download is "
                "incomplete: fetch the missing files"
            )
        listed = set(weight_map.values())
        stray = sorted(
            p.name
            for p in folder.glob("*.safetensors")
            if p.name not in listed and p.name != ENGRAM_FILE
        )
        if stray:
            raise HFLoadError(
                f"{folder} holds {stray} beside {INDEX_FILE}, which does not list them: files of "
                "two models are mixed (an export into a used folder?). Remove the stray files or "
                "the stale index and its shards (re-export with --overwrite)"
            )
        return {str(k): str(v) for k, v in weight_map.items()}
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in folder.glob("*.bin"))
        hint = (
            f" It holds PyTorch .bin files ({bins[0]}, ...): re-download the safetensors "
            "variant, or convert with safetensors.torch.save_file."
            if bins
            else ""
        )
        raise HFLoadError(f"no *.safetensors files in {folder}.{hint}")
    key_files: dict[str, str] = {}
    for file in files:
        with safe_open(folder / file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in key_files:
                    raise HFLoadError(
                        f"tensor {name!r} is in both {key_files[name]} and {file} in {folder}: "
                        f"remove the stray file, or add the {INDEX_FILE} that says which is used"
                    )
                key_files[name] = file
    return key_files


def _check_hf_config(folder: Path, args: ModelArgs) -> None:
    """Compare config.json (when present) with the model: another shape is an error before any
    read; another function (RoPE, norm eps, an unsupported feature) a warning, because the
    recipes' model builder already refused it unless model.hf_config_mismatch = "warn"."""
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        return
    config = read_hf_config(folder)
    # Some configs omit head_dim (then it is hidden_size / num_attention_heads, as ours).
    diffs = [
        f"{hf_key} = {config[hf_key]} but the model has {ours} = {getattr(args, ours)}"
        for hf_key, ours in _CONFIG_SHAPE.items()
        if hf_key in config and config[hf_key] is not None and config[hf_key] != getattr(args, ours)
    ]
    if diffs:
        raise HFLoadError(
            f"{config_file} describes another model shape:\n  "
            + "\n  ".join(diffs)
            + "\nFix: set model.flavor = 'hf' to take the shape from config.json, or the "
            "named model.name / model.flavor of the checkpoint's architecture"
        )
    try:
        _, theirs = args_from_hf_config(config, args.max_seq_len)
    except HFConfigError as e:
        logger.warning("%s: %s; the pretrained function will differ", config_file, e)
        return
    for hf_key, ours in _CONFIG_NUMERIC.items():
        if getattr(theirs, ours) != getattr(args, ours):
            logger.warning(
                "%s: %s = %s but the model uses %s = %s; the pretrained function will differ "
                "(model.flavor = 'hf' takes every value from config.json)",
                config_file, hf_key, getattr(theirs, ours), ours, getattr(args, ours),
            )  # fmt: skip


# The settings of config.json's `engram` that decide which table row a token reads: another
# value than this run's would load tables addressed by another hash.
_ENGRAM_HASHING = ("seed", "max_ngram", "n_head_per_ngram", "vocab_size_per_ngram")


def _check_engram_config(folder: Path, ours) -> None:
    """An exported folder's `engram` section: its stored multipliers / primes must be what its
    seed and sizes derive (an edited file is refused by key), and its hashing settings this
    run's (`ours`: the model's EngramConfig)."""
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        return
    engram = read_hf_config(folder).get("engram")
    if not isinstance(engram, dict):
        return
    try:
        check_hash_params(engram, str(config_file))
    except ValueError as e:
        raise HFLoadError(str(e)) from None
    if ours is None or not ours.enabled:
        return
    diffs = [
        f"engram.{k} = {engram.get(k)} in the folder, {getattr(ours, k)} in this run"
        for k in _ENGRAM_HASHING
        if engram.get(k) != getattr(ours, k)
    ]
    if diffs:
        raise HFLoadError(
            f"{config_file} hashes n-grams differently from this run:\n  "
            + "\n  ".join(diffs)
            + "\nIts tables would be read at other rows. Fix: set these engram.* values to the "
            "folder's (its config.json engram_titan.training_config is the run it came from)"
        )


# ----------------------------------------------------------------------------- plan and checks


def _parameters(model: nn.Module, allow_meta: bool = False) -> dict[str, torch.Tensor]:
    """Wrapper-free name -> parameter; a tied weight appears once (under tok_embeddings)."""
    params: dict[str, torch.Tensor] = {}
    for raw_name, p in model.named_parameters():
        if p.device.type == "meta" and not allow_meta:
            raise HFLoadError(
                f"parameter {clean_fqn(raw_name)} is on the meta device: call load_hf_backbone "
                "after model.to_empty(device=...) and model.init_weights(...)"
            )
        params[clean_fqn(raw_name)] = p
    return params


def _other_stage(model: nn.Module):
    """Under pipeline parallelism `model` is one stage: a predicate for the parameter names that
    another stage holds (its layers are deleted, its embedding / norm / head set to None)."""
    layers = getattr(model, "layers", None)
    held = set(layers.keys()) if layers is not None else None

    def other(name: str) -> bool:
        head, _, rest = name.partition(".")
        if head == "layers" and held is not None:
            return rest.partition(".")[0] not in held
        return head in ("tok_embeddings", "norm", "output") and getattr(model, head, 0) is None

    return other


def _plan(
    folder: Path,
    key_files: dict[str, str],
    params: dict[str, torch.Tensor],
    args: ModelArgs,
    other_stage=lambda name: False,
) -> dict[str, tuple[str, str]]:
    """Our parameter name -> (HF name, file). Errors list every missing and unexpected tensor;
    tensors of another pipeline stage's parameters are skipped (that stage loads them)."""
    plan: dict[str, tuple[str, str]] = {}
    unexpected: list[str] = []
    placeholder = torch.empty(0)
    for hf_name, file in sorted(key_files.items()):
        try:
            # One key at a time, so every unknown key is reported, not only the first.
            mapped = from_hf_state_dict({hf_name: placeholder}, args)
        except KeyError as e:
            unexpected.append(f"{hf_name} (in {file}): {e.args[0]}")
            continue
        for ours in mapped:  # empty for ignored keys (rotary inv_freq, a tied lm_head)
            if ours in params:
                plan[ours] = (hf_name, file)
            elif not other_stage(ours):
                unexpected.append(
                    f"{hf_name} (in {file}): maps to {ours}, which this model does not have"
                )
    # LoRA adapters have no HF counterpart: like Engram parameters they keep their init.
    backbone = [n for n in params if not is_engram_param(n) and not is_lora_param(n)]
    engram = [n for n in params if is_engram_param(n)]
    missing = [n for n in backbone if n not in plan]
    engram_found = [n for n in engram if n in plan]
    if engram_found:  # a folder that carries Engram weights must carry all of them
        missing += [n for n in engram if n not in plan]
    if not missing and not unexpected:
        return plan
    lines = [f"HF checkpoint {folder} does not match this model ({_describe(args)}):"]
    if missing:
        lines.append(f"  missing from the checkpoint ({len(missing)}):")
        lines += [f"    {n}" for n in missing[:_MAX_LISTED]]
        if len(missing) > _MAX_LISTED:
            lines.append(f"    ... and {len(missing) - _MAX_LISTED} more")
    if unexpected:
        lines.append(f"  unexpected in the checkpoint ({len(unexpected)}):")
        lines += [f"    {u}" for u in unexpected[:_MAX_LISTED]]
        if len(unexpected) > _MAX_LISTED:
            lines.append(f"    ... and {len(unexpected) - _MAX_LISTED} more")
    if "output.weight" in missing and "tok_embeddings.weight" not in missing:
        lines.append(
            "  (no lm_head.weight: the checkpoint ties its embeddings; model.flavor = 'hf' "
            "reads tie_word_embeddings from its config.json)"
        )
    lines.append(
        "Fix: set model.name to the checkpoint's architecture (llama3, qwen2 = Qwen2/2.5, qwen3) "
        "and model.flavor = 'hf' (its shape from config.json), or point model.hf_checkpoint at "
        "the complete folder"
    )
    raise HFLoadError("\n".join(lines))


def _check_shapes(
    folder: Path, plan: dict[str, tuple[str, str]], params: dict[str, torch.Tensor]
) -> None:
    """Global shapes from the safetensors headers (no tensor data is read)."""
    wrong: list[str] = []
    by_file: dict[str, list[str]] = {}
    for ours, (_, file) in plan.items():
        by_file.setdefault(file, []).append(ours)
    for file, names in sorted(by_file.items()):
        with safe_open(folder / file, framework="pt", device="cpu") as f:
            for ours in names:
                hf_name = plan[ours][0]
                shape = tuple(f.get_slice(hf_name).get_shape())
                if shape != tuple(params[ours].shape):
                    wrong.append(
                        f"{ours}: checkpoint {hf_name} in {file} has shape {list(shape)}, the "
                        f"model expects {list(params[ours].shape)}"
                    )
    if wrong:
        raise HFLoadError(
            f"HF checkpoint {folder} has tensors of other shapes than this model:\n  "
            + "\n  ".join(wrong[:_MAX_LISTED])
            + ("\n  ..." if len(wrong) > _MAX_LISTED else "")
            + "\nFix: set model.flavor to the checkpoint's size (and model.vocab_size to its "
            "vocab_size if you overrode it); Engram tables must match engram.* settings"
        )


def _local_shard(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(local tensor to copy into, its offset in the global tensor)."""
    if isinstance(param, DTensor):
        for placement in param.placements:
            # FSDP2 over TP gives _StridedShard: still one contiguous block (local_view checks).
            if not isinstance(placement, (Shard, _StridedShard, Replicate)):
                raise NotImplementedError(
                    f"loading into a DTensor with placements {param.placements} is not supported; "
                    "load_hf_backbone handles Shard / Replicate layouts (FSDP2, HSDP, DDP, TP, "
                    "tables)"
                )
    local, _, offset = local_view(param)
    return local, offset


def _describe(args: ModelArgs) -> str:
    return (
        f"dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads / {args.n_kv_heads} kv, "
        f"ffn {args.ffn_dim}, vocab {args.vocab_size}, qkv_bias {args.qkv_bias}, "
        f"qk_norm {args.qk_norm}"
    )
