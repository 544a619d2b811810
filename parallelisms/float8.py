"""float8 training of the decoder's linears through torchao (`convert_to_float8_training`).

torchao swaps each eligible `nn.Linear` for a `Float8Linear`: the weight stays a high-precision
parameter (fp32 master weight, FSDP shards and reduces it like any other); input, weight and
output gradient are cast to float8 with dynamic scales inside every matmul (rowwise: one scale per
row, torchao's recommended recipe; tensorwise: one per tensor). Communication stays in high
precision.

What is never float8:
- Engram tables: they are embeddings (`F.embedding` / the sharded all-to-all lookup), not
  linears; `convert_to_float8_training` only swaps `nn.Linear`, and `_eligible` refuses any
  module under a table as a second guard.
- `filter_fqns` (default: the output head and the small Engram projections, which are accuracy
  sensitive and too small for float8 to pay off).
- Linears with a dimension not divisible by 16 (the float8 matmul `torch._scaled_mm` needs
  multiples of 16): skipped and listed in the log.

Gates, each an error naming the fix: torchao missing; `job.device = "npu"` (Ascend 910B / 910C have
no float8 matmul); CUDA compute capability < 8.9; CPU without `emulate` (emulation computes the
float8 numerics in high precision: tests only, no speed-up).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from engram.config import ConfigError
from engram.config import Float8 as Float8Config

logger = logging.getLogger(__name__)

__all__ = ["apply_float8", "check_float8_device", "float8_filter"]

# torch._scaled_mm: both matmul dimensions of the weight must be multiples of 16.
_FLOAT8_MULTIPLE = 16
TORCHAO_INSTALL = 'pip install "torchao>=0.18" (or pip install -e ".[float8]")'


def check_float8_device(cfg: Float8Config, device_type: str) -> None:
    """Raise ConfigError when float8 training cannot run on `device_type`."""
    if device_type == "npu":
        raise ConfigError(
            "float8.enable=true with job.device npu: Ascend 910B / 910C have no float8 matmul "
            "(only Ascend 950 lists FP8 inputs); set float8.enable=false and train in bf16 "
            "(parallelism.mixed_precision_param=bfloat16)"
        )
    if cfg.emulate:
        return
    if device_type == "cpu":
        raise ConfigError(
            "float8.enable=true on cpu: there is no float8 matmul on CPU; set float8.emulate=true "
            "to check float8 numerics (no speed-up, tests only) or float8.enable=false"
        )
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"float8.enable=true needs CUDA compute capability >= 8.9 (H100 / H200 / L40S / "
                f"B200 class), this GPU has {major}.{minor}: set float8.enable=false and train in "
                "bf16 (parallelism.mixed_precision_param=bfloat16)"
            )


def _torchao_float8():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise ImportError(
            f"float8.enable=true needs torchao, which is not installed: {TORCHAO_INSTALL}; "
            "or set float8.enable=false"
        ) from e
    return Float8LinearConfig, Float8Linear, convert_to_float8_training


def _table_prefixes(model: nn.Module) -> list[str]:
    """FQN prefixes of the Engram tables (`<block>.table`), which must never become float8."""
    tables = {id(block.table) for block in model.engram_blocks().values()}
    return [name for name, m in model.named_modules() if id(m) in tables]


def float8_filter(model: nn.Module, cfg: Float8Config):
    """The module_filter_fn given to torchao, and the lists it fills: (fn, skipped_for_shape)."""
    tables = _table_prefixes(model)
    skipped: list[str] = []

    def eligible(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(fqn == t or fqn.startswith(t + ".") for t in tables):
            return False
        if any(f in fqn for f in cfg.filter_fqns):
            return False
        if module.in_features % _FLOAT8_MULTIPLE or module.out_features % _FLOAT8_MULTIPLE:
            skipped.append(f"{fqn} ({module.in_features} -> {module.out_features})")
            return False
        return True

    return eligible, skipped


def apply_float8(
    model: nn.Module, cfg: Float8Config, device_type: str, compiled: bool
) -> list[str]:
    """Swap eligible linears for torchao's Float8Linear in place (works on meta); returns their
    names. Must run before tensor parallelism (TP then uses float8-aware styles) and before
    activation checkpointing, compile and FSDP wrap the modules."""
    if not cfg.enable:
        return []
    check_float8_device(cfg, device_type)
    Float8LinearConfig, Float8Linear, convert_to_float8_training = _torchao_float8()
    ao_cfg = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(cfg.recipe), emulate=cfg.emulate
    )
    eligible, skipped = float8_filter(model, cfg)
    convert_to_float8_training(model, module_filter_fn=eligible, config=ao_cfg)
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    if skipped:
        logger.info(
            f"float8: kept in high precision (a dimension is not a multiple of "
            f"{_FLOAT8_MULTIPLE}): {', '.join(skipped)}"
        )
    if not converted:
        raise ConfigError(
            "float8.enable=true but no linear qualifies (filtered by float8.filter_fqns="
            f"{cfg.filter_fqns} or a dimension not a multiple of {_FLOAT8_MULTIPLE}): "
            "set float8.enable=false or narrow float8.filter_fqns"
        )
    logger.info(
        f"float8 ({cfg.recipe}{', emulated' if cfg.emulate else ''}): {len(converted)} linears"
    )
    if not compiled:
        logger.warning(
            "float8 without compile.enable: the float8 casts run as separate unfused kernels, "
            "usually slower than bf16; set compile.enable=true"
        )
    return converted
