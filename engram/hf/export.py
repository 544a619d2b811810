"""Safetensors export: the way to share weights (a safetensors file holds no code).

(a) a self-contained Hugging Face folder that transformers loads as the full model:

        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        AutoTokenizer.from_pretrained(folder, trust_remote_code=True)

    (model_type engram_llama / engram_qwen2 / engram_qwen3: without the flag transformers refuses
    the model rather than build the plain backbone; PreTrainedTokenizerFast reads the tokenizer
    without the folder's code)

    model.safetensors (the backbone in HF Llama/Qwen names; Engram weights under
    `model.layers.<i>.engram.*`; the tokenizer compression table as `engram_hash.lookup`),
    config.json (the family's config plus `engram`: layer ids, seeds, multipliers, primes, table
    sizes; `engram_titan`: repo version, checkpoint fingerprint and the training config),
    modeling_engram.py (engram/hf/remote/, torch + transformers only; `auto_map` points its
    config and model classes to it),
    tokenizer.json + tokenizer_config.json and generation_config.json. Without Engram the folder
    is a plain Llama / Qwen2 / Qwen3 checkpoint (no remote code). It also loads back into any
    layout with `engram.hf.load.load_hf_backbone` (model.hf_checkpoint = folder).
(b) engram.safetensors alone (Engram-only weights, `engram.<our name>`, with the Engram config
    and checkpoint fingerprint as JSON in the safetensors header), read back with
    `load_engram_safetensors`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, processors
from torch import nn

from engram.checkpoint import fingerprint_mismatches
from engram.checkpoint.run_folder import run_folder_markers
from engram.data.chat_template import chat_template_fields
from engram.hf.adapter import ENGRAM_PREFIX, HASH_LOOKUP, to_hf_state_dict
from engram.hf.checksums import CHECKSUMS_FILE, verify_folder, write_checksums
from engram.hf.hash_params import check_hash_params
from engram.models.args import ModelArgs
from engram.models.engram import is_engram_param
from engram.models.init import local_view
from engram.models.lora import is_lora_param
from engram.models.transformer import clean_fqn

logger = logging.getLogger("engram")

ENGRAM_FILE = "engram.safetensors"
# Files of an HF model folder: what an export writes or another export / download left there.
_MODEL_FILE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "modeling_engram.py",
    "adapter_config.json",
    CHECKSUMS_FILE,
)
ENGRAM_FORMAT = "engram-safetensors/1"
MODELING_FILE = Path(__file__).parent / "remote" / "modeling_engram.py"
# model.name -> (plain architecture, model_type, Engram architecture); an Engram folder's
# model_type is "engram_" + the plain one (exports before it kept the plain one:
# engram/models/hf_config.py reads both)
_ARCH = {
    "llama3": ("LlamaForCausalLM", "llama", "EngramLlamaForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", "EngramQwen2ForCausalLM"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", "EngramQwen3ForCausalLM"),
}


class EngramExportError(ValueError):
    """An Engram safetensors file does not fit the model; the message says what differs."""


def hf_config(args: ModelArgs, family: str) -> dict[str, Any]:
    """config.json for the backbone (transformers 5 layout: RoPE in `rope_parameters`)."""
    if family not in _ARCH:
        raise EngramExportError(
            f"model.name {family!r} has no Hugging Face export: supported {', '.join(_ARCH)}"
        )
    # What transformers' class of the family computes: anything else would load silently wrong.
    want = {"llama3": (False, False), "qwen2": (True, False), "qwen3": (False, True)}[family]
    if (args.qkv_bias, args.qk_norm) != want:
        raise EngramExportError(
            f"a {family} model with qkv_bias = {args.qkv_bias}, qk_norm = {args.qk_norm} has no "
            f"transformers class (its {_ARCH[family][0]} computes qkv_bias = {want[0]}, qk_norm = "
            f"{want[1]}): export a shape of the family"
        )
    arch, model_type = _ARCH[family][:2]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **dataclasses.asdict(args.rope_scaling)}
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "intermediate_size": args.ffn_dim,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if family == "qwen2":
        config["attention_bias"] = args.qkv_bias
    return config


def engram_hf_config(model: nn.Module, hasher: Any) -> dict[str, Any]:
    """config.json's `engram`: everything the modeling file needs to hash and build the blocks."""
    cfg = model.engram_cfg
    blocks = model.engram_blocks()
    rows = {i: int(b.table.weight.shape[0]) for i, b in blocks.items()}
    if rows != {int(i): int(r) for i, r in hasher.table_rows.items()}:
        raise EngramExportError(f"table rows {rows} differ from the hasher's {hasher.table_rows}")
    layers = hasher.layer_ids
    engram = {
        "layer_ids": layers,
        "max_ngram": hasher.max_ngram,
        "n_head_per_ngram": hasher.n_head_per_ngram,
        "n_embed_per_ngram": cfg.n_embed_per_ngram,
        "head_dim": cfg.head_dim,
        "kernel_size": cfg.kernel_size,
        "hc_mult": cfg.hc_mult,
        "use_bias": cfg.use_bias,
        "seed": cfg.seed,
        "vocab_size_per_ngram": [int(v) for v in cfg.vocab_size_per_ngram],
        "pad_id": hasher.pad_id,
        "compressed_pad_id": hasher.compressed_pad_id,
        "num_token_ids": hasher.num_ids,
        "compressed_vocab": hasher.compressed_vocab,
        "table_primes": {str(i): [int(p) for p in hasher.table_sizes[i]] for i in layers},
        "table_rows": {str(i): rows[i] for i in layers},
        "multipliers": {
            str(i): [int(m) for m in hasher.multipliers[k]] for k, i in enumerate(layers)
        },
    }
    check_hash_params(engram, "the export")  # readers derive them again: they must agree
    return engram


def provenance(config_toml: str, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """config.json's `engram_titan`: where the folder came from."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "version": metadata.version("engram-titan"),
        "git_commit": commit,
        "fingerprint": fingerprint,
        "training_config": config_toml,
    }


def full_cpu(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (DTensor) parameter, detached, on the CPU (collective for a DTensor)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().to("cpu").contiguous()


def _check_finite(tensors: dict[str, torch.Tensor]) -> None:
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise EngramExportError(
            f"not exporting non-finite weights (NaN/inf in {bad[:5]}): the checkpoint is damaged "
            "or training diverged; export an earlier step (--step)"
        )


def _tokenizer_files(
    out: Path, tokenizer: Any, max_len: int, suppress: list[int], chat_template: str = ""
) -> None:
    """The run's tokenizer.json with one change, plus transformers' settings. Our packer starts
    every document with eos (engram/data/), so the model only ever saw text after an eos: the
    post-processor becomes "eos $A" (it replaces the tokenizer's own, e.g. Llama-3's
    begin_of_text, which training never put there) and HF's bos token is eos, so
    `tokenizer(prompt)` starts a prompt as training did and as recipes/generate.py does by
    default (`--prefix eos`). Encoding with add_special_tokens=False is the run's tokenizer."""
    hf = Tokenizer.from_str(tokenizer.hf.to_str())
    eos = hf.id_to_token(tokenizer.eos_id)
    hf.post_processor = processors.TemplateProcessing(
        single=f"{eos}:0 $A:0",
        pair=f"{eos}:0 $A:0 {eos}:1 $B:1",
        special_tokens=[(eos, tokenizer.eos_id)],
    )
    hf.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": eos,
        "pad_token": hf.id_to_token(tokenizer.pad_id),
        "model_max_length": max_len,
    }
    chat, stops = chat_template_fields(tokenizer, chat_template)
    (out / "tokenizer_config.json").write_text(json.dumps({**config, **chat}, indent=2) + "\n")
    generation = {
        "bos_token_id": tokenizer.eos_id,
        "eos_token_id": [tokenizer.eos_id, *stops] if stops else tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        # Rows past the tokenizer (padded embeddings) have no token to hash or decode.
        **({"suppress_tokens": suppress} if suppress else {}),
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def export(
    model: nn.Module,
    family: str,
    engram_config: dict[str, Any],
    fingerprint: dict[str, Any],
    out: str | Path,
    engram_only: bool = False,
    tokenizer: Any = None,
    hasher: Any = None,
    config_toml: str = "",
    chat_template: str = "",
) -> list[Path]:
    """Write (a) the self-contained HF folder or (b) only engram.safetensors into `out`;
    returns the files. (a) needs the run's `tokenizer` and, with Engram, its `hasher`.

    `model` must hold full (unsharded) tensors or DTensors (gathered here: collective then)."""
    out = Path(out)
    sd = {name: full_cpu(p) for name, p in model.state_dict().items()}
    adapters = [name for name in sd if is_lora_param(name)]
    if adapters and not engram_only:
        raise ValueError(
            f"the model has LoRA adapters ({adapters[0]}, ...): write them with "
            "engram.hf.peft.export_peft, or fold them in first (engram.models.lora.merge_lora_)"
        )
    sd = {name: t for name, t in sd.items() if not is_lora_param(name)}
    _check_finite(sd)
    hf = to_hf_state_dict(sd, model.args)
    engram = {k: v for k, v in hf.items() if k.startswith(ENGRAM_PREFIX)}
    if engram_only:
        if not engram:
            raise EngramExportError("--engram-only: this model has no Engram layers")
        out.mkdir(parents=True, exist_ok=True)
        header = {
            "format": ENGRAM_FORMAT,
            "engram_config": json.dumps(engram_config, sort_keys=True),
            "fingerprint": json.dumps(fingerprint, sort_keys=True),
        }
        save_file(engram, str(out / ENGRAM_FILE), metadata=header)
        return [out / ENGRAM_FILE, write_checksums(out, [ENGRAM_FILE])]
    if tokenizer is None:
        raise ValueError("export of a Hugging Face folder needs the run's tokenizer")
    config = hf_config(model.args, family)
    tensors = {k: v for k, v in hf.items() if not k.startswith(ENGRAM_PREFIX)}
    if engram:
        if hasher is None:
            raise ValueError("export of an Engram model needs the run's NgramHasher")
        # `engram.layers.<i>.engram.X` -> the modeling file's `model.layers.<i>.engram.X`.
        tensors.update({"model." + k[len(ENGRAM_PREFIX) :]: v for k, v in engram.items()})
        lookup = hasher.lookup if hasher.lookup is not None else range(hasher.num_ids)
        tensors[HASH_LOOKUP] = torch.as_tensor(lookup, dtype=torch.int64).clone()
        arch = _ARCH[family][2]
        # A model_type of its own: with the backbone's, AutoModelForCausalLM without
        # trust_remote_code builds the plain backbone and drops every Engram weight (exit 0).
        # transformers knows no engram_* type, so it asks for the flag (the config class is the
        # folder's code too); the tokenizer is found through tokenizer_config.json's class.
        config.update(
            architectures=[arch],
            model_type="engram_" + config["model_type"],
            auto_map={
                "AutoConfig": f"{MODELING_FILE.stem}.{arch.replace('ForCausalLM', 'Config')}",
                "AutoModelForCausalLM": f"{MODELING_FILE.stem}.{arch}",
            },
            engram=engram_hf_config(model, hasher),
        )
    config.update(
        eos_token_id=tokenizer.eos_id,
        bos_token_id=tokenizer.eos_id,  # a document starts after eos (_tokenizer_files)
        pad_token_id=tokenizer.pad_id,
        engram_titan=provenance(config_toml, fingerprint),
    )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written = [out / "model.safetensors", out / "config.json"]
    if engram:
        shutil.copyfile(MODELING_FILE, out / MODELING_FILE.name)
        written.append(out / MODELING_FILE.name)
    suppress = list(range(tokenizer.vocab_size, model.args.vocab_size))
    _tokenizer_files(out, tokenizer, model.args.max_seq_len, suppress, chat_template)
    names = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
    written += [out / n for n in names]
    return written + [write_checksums(out, written)]


def check_not_run_folder(
    out: str | Path, checkpoint: str | Path | None = None, checkpoint_folder: str = "checkpoint"
) -> None:
    """Refuse an export folder that is, or is inside, a training run's folder
    (run_folder_markers: an export there mixes with the run's files, --overwrite deletes some),
    or that contains `checkpoint` (the step folder being exported)."""
    out = Path(out).resolve()
    for folder in (out, *out.parents):
        markers = run_folder_markers(folder, checkpoint_folder)
        if markers:
            where = "is" if folder == out else f"is inside {folder}, which is"
            raise FileExistsError(
                f"--out {out} {where} a training run's folder (it holds {', '.join(markers)}): "
                "an export there would mix with or replace the run's files. Export to a folder "
                "outside the run, e.g. --out exported/<run name>"
            )
    if checkpoint is not None:
        ckpt = Path(checkpoint).resolve()
        if ckpt == out or out in ckpt.parents:
            raise FileExistsError(
                f"--out {out} contains the checkpoint being exported ({ckpt}): --overwrite would "
                "delete its files. Export to a folder outside the run"
            )


def prepare_output_folder(
    out: str | Path,
    overwrite: bool,
    checkpoint: str | Path | None = None,
    checkpoint_folder: str = "checkpoint",
) -> None:
    """Refuse a run's folder, or one holding `checkpoint` (check_not_run_folder), and a
    non-empty export folder (a new export beside an old one's files mixes two models) unless
    `overwrite`; then remove the model files an export writes or replaces (any safetensors,
    index, config, tokenizer and checksum files) and keep, with a warning, anything else."""
    check_not_run_folder(out, checkpoint, checkpoint_folder)
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a folder")
    present = sorted(p.name for p in out.iterdir())
    if not present:
        return
    if not overwrite:
        raise FileExistsError(
            f"--out {out} is not empty ({', '.join(present[:6])}{', ...' if len(present) > 6 else ''}"
            "): an export beside an earlier one's files mixes two models. Choose an empty or "
            "new folder, or pass --overwrite to replace its model files"
        )
    replaced = sorted({p for pat in _MODEL_FILE_PATTERNS for p in out.glob(pat) if p.is_file()})
    for p in replaced:
        p.unlink()
    kept = sorted(set(present) - {p.name for p in replaced})
    logger.warning("--overwrite: removed %s from %s", [p.name for p in replaced], out)
    if kept:
        logger.warning("--overwrite: kept files an export does not write: %s", kept)


def read_engram_header(file: str | Path) -> dict[str, Any]:
    """The Engram config and fingerprint stored in an engram.safetensors header."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
    if meta.get("format") != ENGRAM_FORMAT:
        raise EngramExportError(
            f"{file} is not an Engram safetensors file (header format {meta.get('format')!r}, "
            f"expected {ENGRAM_FORMAT!r}): export it with scripts/export_hf.py"
        )
    return {k: json.loads(meta[k]) for k in ("engram_config", "fingerprint")}


def load_engram_safetensors(
    model: nn.Module, file: str | Path, fingerprint: dict[str, Any] | None = None
) -> int:
    """Copy the Engram weights of `file` into `model`'s (local shards of) Engram parameters, in
    any layout; returns how many tensors were copied. With `fingerprint` (this run's
    engram.checkpoint.fingerprint.config_fingerprint) the Engram-related keys of the file's fingerprint
    must match it (same hashing, tables, widths), else EngramExportError naming them. The
    folder's checksums.sha256, when present, must hold (engram/hf/checksums.py)."""
    verify_folder(Path(file).parent)
    header = read_engram_header(file)
    if fingerprint is not None:
        keys = [k for k in fingerprint if k.startswith("engram") or k == "tokenizer"]
        diffs = fingerprint_mismatches(
            {k: header["fingerprint"].get(k) for k in keys}, {k: fingerprint[k] for k in keys}
        )
        if diffs:
            raise EngramExportError(
                f"{file} holds Engram weights for another configuration:\n  "
                + "\n  ".join(diffs)
                + "\nFix: use the Engram config in the file's header (read_engram_header)"
            )
    params = {}
    for raw, p in model.named_parameters():
        name = clean_fqn(raw)
        if is_engram_param(name):
            params[name] = p
    with safe_open(str(file), framework="pt", device="cpu") as f:
        stored = {k[len(ENGRAM_PREFIX) :]: k for k in f.keys()}
        missing, extra = sorted(set(params) - set(stored)), sorted(set(stored) - set(params))
        if missing or extra:
            raise EngramExportError(
                f"{file} does not match this model's Engram parameters: missing {missing[:10]}, "
                f"unexpected {extra[:10]}. Fix: set engram.layer_ids and the engram.* widths to "
                "the file's header"
            )
        with torch.no_grad():
            for name, p in params.items():
                shape = tuple(f.get_slice(stored[name]).get_shape())
                if shape != tuple(p.shape):
                    raise EngramExportError(
                        f"{file}: {name} has shape {list(shape)}, the model {list(p.shape)}"
                    )
                local, local_shape, offset = local_view(p)
                if local.numel() == 0:
                    continue
                index = tuple(slice(o, o + s) for o, s in zip(offset, local_shape, strict=True))
                local.copy_(
                    f.get_slice(stored[name])[index] if index else f.get_tensor(stored[name])
                )
    return len(params)
