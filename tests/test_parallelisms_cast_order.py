"""Every dtype cast of a parameter happens before FSDP2 wraps it (parallelisms/parallelize.py).

Why it matters: torch_npu's dtype cast (`npu._npu_dtype_cast`) has no DTensor sharding strategy,
so a `.to(dtype)` on an FSDP-sharded parameter fails on Ascend (modelscope/ms-swift#7870,
modelscope/ms-swift#7871) although it works on CPU / CUDA. Two checks over the whole placement
(parallelize, materialise, init) in lora mode with a bf16 frozen backbone at 2 gloo ranks: when
`fully_shard` is called, the frozen parameters already hold their final dtype; and no call
changes the dtype of a DTensor.
"""

from __future__ import annotations

import pytest
import torch
from launcher import run_distributed
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from tests.small_job import small_job

pytestmark = pytest.mark.slow


class DTensorCasts(TorchFunctionMode):
    """Records every torch call that returns a tensor of another dtype than its DTensor input."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = args[0] if args else None
        if isinstance(src, DTensor) and isinstance(out, torch.Tensor) and out.dtype != src.dtype:
            self.casts.append(f"{getattr(func, '__name__', func)}: {src.dtype} -> {out.dtype}")
        return out


def _place(rank: int, world_size: int, tmp: str) -> dict:
    import parallelisms.fsdp as fsdp
    from engram.config import config_from_dict
    from engram.optim.builder import is_trainable
    from engram.train.build import build_meta_model
    from parallelisms.parallel_dims import parallel_dims_from_config
    from runner.model_parts import build_model_parts

    extra = {
        "training": {"mode": "lora"},
        "parallelism": {"mixed_precision_param": "bfloat16"},
    }
    cfg = config_from_dict(small_job(tmp, "cast", world_size, 1, extra))
    dims = parallel_dims_from_config(cfg, world_size)
    dims.build_mesh("cpu")
    _, _, model = build_meta_model(cfg)

    at_wrap: dict[str, torch.dtype] = {}
    fully_shard = fsdp.fully_shard

    def spy(module, *args, **kwargs):
        prefix = {id(m): n for n, m in model.named_modules()}[id(module)]
        for name, p in module.named_parameters():  # a layer's first: at its own fully_shard
            at_wrap.setdefault(f"{prefix}.{name}" if prefix else name, p.dtype)
        return fully_shard(module, *args, **kwargs)

    fsdp.fully_shard = spy
    try:
        with DTensorCasts() as spy_mode:
            parts, _, _ = build_model_parts(model, cfg, dims, torch.device("cpu"))
    finally:
        fsdp.fully_shard = fully_shard
    frozen = {n for n, p in parts[0].named_parameters() if not is_trainable(n, "lora")}
    prefixes = ("_checkpoint_wrapped_module.", "_orig_mod.")
    wrapped = {
        name.replace(prefixes[0], "").replace(prefixes[1], ""): dtype
        for name, dtype in at_wrap.items()
    }
    return {
        "casts": spy_mode.casts,
        "frozen_at_wrap": sorted({str(wrapped[n]) for n in frozen if n in wrapped}),
        "frozen_seen": len(frozen & set(wrapped)),
        "frozen": len(frozen),
        "final": sorted({str(p.dtype) for n, p in parts[0].named_parameters() if n in frozen}),
    }


@pytest.mark.parametrize("world", [1, 2])  # 1: FSDP2 on the size-1 mesh casts there too
def test_dtype_casts_happen_before_fully_shard(tmp_path, world) -> None:
    for result in run_distributed(_place, world, str(tmp_path)):
        assert result["casts"] == [], result["casts"]
        assert result["frozen"] > 0 and result["frozen_seen"] == result["frozen"], result
        assert result["frozen_at_wrap"] == ["torch.bfloat16"] == result["final"], result
