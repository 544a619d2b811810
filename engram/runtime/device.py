"""One device layer for CUDA GPUs, Ascend NPUs and the CPU.

Everything device-specific goes through these functions so the recipes never name torch.cuda or
torch.npu. torch_npu is imported only when the device type is "npu" (or "auto" finds it
installed): importing this module, or running on cuda / cpu, never imports it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import resource
import sys
import warnings
from types import ModuleType

import torch

DEVICE_TYPES = ("cuda", "npu", "cpu")
_GIB = float(1 << 30)

_NPU_INSTALL_HINT = (
    "install the Ascend CANN toolkit and source its environment "
    "(e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`), then "
    "`pip install torch_npu` at the version that matches your torch (torch_npu needs the CPU "
    "build of torch); or set the device type to 'cuda' / 'cpu'"
)


def _check_type(device_type: str) -> None:
    if device_type not in DEVICE_TYPES:
        raise ValueError(
            f"unknown device type {device_type!r}: use one of {', '.join(DEVICE_TYPES)} or 'auto'"
        )


def import_device_backend(device_type: str) -> None:
    """Import the out-of-tree backend for `device_type` (torch_npu for "npu"); no-op otherwise."""
    _check_type(device_type)
    if device_type != "npu" or sys.modules.get("torch_npu") is not None:
        return
    try:
        importlib.import_module("torch_npu")
    except ImportError as e:  # the package, or CANN's shared libraries, are missing
        raise RuntimeError(
            f"device type 'npu' needs torch_npu, which failed to import ({e}): {_NPU_INSTALL_HINT}"
        ) from e


def _npu_available() -> bool:
    """True if torch_npu is installed, imports, and sees at least one NPU."""
    if sys.modules.get("torch_npu") is None and importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import_device_backend("npu")
    except RuntimeError as e:
        warnings.warn(f"torch_npu is installed but unusable, falling back: {e}", stacklevel=3)
        return False
    return bool(torch.npu.is_available())


def resolve_device_type(requested: str = "auto") -> str:
    """Map "auto" / "cuda" / "npu" / "cpu" to a usable device type, importing torch_npu for npu.

    "auto" picks cuda if available, else npu if torch_npu imports and sees a device, else cpu.
    An explicit accelerator that is not available is an error, never a silent CPU fallback.
    """
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "npu" if _npu_available() else "cpu"
    _check_type(requested)
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "device type 'cuda' requested but torch.cuda.is_available() is False: install a CUDA "
            "build of torch and check the driver / CUDA_VISIBLE_DEVICES, or use 'cpu'"
        )
    if requested == "npu":
        import_device_backend("npu")
        if not torch.npu.is_available():
            raise RuntimeError(
                "device type 'npu' requested but torch.npu.is_available() is False: check the "
                "driver (`npu-smi info`), the CANN environment and ASCEND_RT_VISIBLE_DEVICES"
            )
    return requested


def device_module(device_type: str) -> ModuleType | None:
    """torch.cuda / torch.npu for accelerators, None for cpu."""
    _check_type(device_type)
    if device_type == "cpu":
        return None
    import_device_backend(device_type)
    return getattr(torch, device_type)


def dist_backend(device_type: str) -> str:
    """The torch.distributed backend for the device: nccl / hccl / gloo."""
    _check_type(device_type)
    return {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[device_type]


def visible_devices_var(device_type: str) -> str | None:
    """The environment variable that restricts which devices a process sees (None on cpu)."""
    _check_type(device_type)
    return {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES", "cpu": None}[
        device_type
    ]


def local_device(device_type: str, local_rank: int) -> torch.device:
    """The device for this local rank; on accelerators also makes it the current device.

    `local_rank` indexes the *visible* devices (the runtime has already applied
    CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES), so with ASCEND_RT_VISIBLE_DEVICES=4,5
    local rank 1 is physical NPU 5 and is addressed as npu:1.
    """
    mod = device_module(device_type)
    if mod is None:
        return torch.device("cpu")
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    count = mod.device_count()
    if local_rank >= count:
        var = visible_devices_var(device_type)
        raise RuntimeError(
            f"local rank {local_rank} needs {local_rank + 1} visible {device_type} devices but "
            f"only {count} are visible ({var}={os.environ.get(var, '<unset>')}): launch at most "
            f"{count} processes per node (NGPU={count}) or widen {var}"
        )
    device = torch.device(device_type, local_rank)
    mod.set_device(device)
    return device


def _as_device(device: torch.device | str) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def memory_stats(device: torch.device | str) -> dict[str, float]:
    """Peak memory since the last reset_peak_memory.

    Accelerators: peak_allocated_gib, peak_reserved_gib, capacity_gib, peak_allocated_pct,
    peak_reserved_pct. CPU: max_rss_gib (the process's peak resident set; it cannot be reset).
    """
    device = _as_device(device)
    if device.type == "cpu":
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports KiB, macOS bytes.
        rss_bytes = rss if sys.platform == "darwin" else rss * 1024
        return {"max_rss_gib": rss_bytes / _GIB}
    mod = device_module(device.type)
    assert mod is not None
    allocated = mod.max_memory_allocated(device)
    reserved = mod.max_memory_reserved(device)
    capacity = mod.get_device_properties(device).total_memory
    return {
        "peak_allocated_gib": allocated / _GIB,
        "peak_reserved_gib": reserved / _GIB,
        "capacity_gib": capacity / _GIB,
        "peak_allocated_pct": 100.0 * allocated / capacity,
        "peak_reserved_pct": 100.0 * reserved / capacity,
    }


def device_name(device: torch.device | str) -> str:
    """What the device calls itself ("NVIDIA H100 80GB HBM3", "Ascend910B2"; "cpu" on cpu): the
    key of device_specs.PEAK_SPECS."""
    device = _as_device(device)
    mod = device_module(device.type)
    return "cpu" if mod is None else str(mod.get_device_name(device))


def mem_get_info(device: torch.device | str) -> tuple[int, int] | None:
    """(free, total) bytes the device reports now (other processes' use included); None on cpu or
    where the device module has no mem_get_info."""
    device = _as_device(device)
    mod = device_module(device.type)
    if mod is None or not hasattr(mod, "mem_get_info"):
        return None
    free, total = mod.mem_get_info(device)
    return int(free), int(total)


def host_memory_bytes() -> int:
    """Physical memory of this host (the cpu "device"'s total)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_memory_bytes(device: torch.device | str) -> tuple[int, int, int]:
    """(peak active, peak reserved, usable) bytes since the last reset_peak_memory.

    Accelerators: the caching allocator's peak of live tensors ("active_bytes.all.peak", or
    max_memory_allocated where memory_stats lacks it), its peak reserved segments, and the total
    the device reports. CPU has no allocator statistics: active and reserved are both the
    process's peak resident set (ru_maxrss: since the process started, never reset; libraries
    included), and usable is the host's physical memory."""
    device = _as_device(device)
    mod = device_module(device.type)
    if mod is None:
        rss = memory_stats(device)["max_rss_gib"] * _GIB
        return int(rss), int(rss), host_memory_bytes()
    stats = mod.memory_stats(device) if hasattr(mod, "memory_stats") else {}
    active = stats.get("active_bytes.all.peak") or mod.max_memory_allocated(device)
    reserved = mod.max_memory_reserved(device)
    return int(active), int(reserved), int(mod.get_device_properties(device).total_memory)


def reset_peak_memory(device: torch.device | str) -> None:
    """Reset the accelerator's peak-memory counters (no-op on cpu)."""
    device = _as_device(device)
    mod = device_module(device.type)
    if mod is not None:
        mod.reset_peak_memory_stats(device)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on the device (no-op on cpu), e.g. before reading a timer."""
    device = _as_device(device)
    mod = device_module(device.type)
    if mod is not None:
        mod.synchronize(device)


# --- launcher / runtime environment (each default only where the user has not set it) -----------

# Fewer fragmentation OOMs on long runs: the documented default of the Ascend training stacks
# (MindSpeed-LLM, SGLang-NPU scripts) and of torchtitan's CUDA launch script.
EXPANDABLE_SEGMENTS = "expandable_segments:True"
ALLOC_CONF_VAR = {"cuda": "PYTORCH_CUDA_ALLOC_CONF", "npu": "PYTORCH_NPU_ALLOC_CONF"}
# torch >= 2.9 also reads this device-neutral name; a user who set it has chosen for cuda.
_ALLOC_CONF_ALIASES = {"cuda": ("PYTORCH_ALLOC_CONF",), "npu": ()}

# Defaults for a 64-rank (8 x 8) job, each overridable by exporting the variable before launch.
# CANN's 120 s connect default is short for eight nodes that start a few minutes apart (image
# pull, environment set-up): the late ones miss the link set-up window. HCCL_EXEC_TIMEOUT (HCCL's
# own default 1800 s) follows the [comm] timeouts (collective_timeout_s below), so HCCL does not
# abort a collective that waits on a checkpoint load / save before torch's timeout would; this
# figure is used without a config (comm's default). The Ascend launch scripts use 7200 for both.
NPU_ENV_DEFAULTS = {
    "HCCL_CONNECT_TIMEOUT": "1200",
    "HCCL_EXEC_TIMEOUT": "3600",
    "PYTORCH_NPU_ALLOC_CONF": EXPANDABLE_SEGMENTS,
}
# job.deterministic on Ascend: deterministic HCCL reductions, and no K-split accumulation-order
# change in matmuls (both read once, when the communicator / kernels are created).
NPU_DETERMINISTIC_ENV = {"HCCL_DETERMINISTIC": "true", "CLOSE_MATMUL_K_SHIFT": "1"}


def env_defaults(device_type: str, collective_timeout_s: float | None = None) -> dict[str, str]:
    """The variables this layer sets on `device_type` when unset, with their defaults: the
    allocator's expandable segments (cuda, npu) and HCCL's timeouts (npu; HCCL_EXEC_TIMEOUT =
    `collective_timeout_s` when given)."""
    _check_type(device_type)
    if device_type == "cpu":
        return {}
    if device_type == "cuda":
        return {ALLOC_CONF_VAR["cuda"]: EXPANDABLE_SEGMENTS}
    defaults = dict(NPU_ENV_DEFAULTS)
    if collective_timeout_s is not None:
        defaults["HCCL_EXEC_TIMEOUT"] = str(int(collective_timeout_s))
    return defaults


def _user_name(var: str, device_type: str) -> str | None:
    """The name under which the user set `var` (itself or an alias), None if unset."""
    aliases = _ALLOC_CONF_ALIASES[device_type] if var == ALLOC_CONF_VAR.get(device_type) else ()
    return next((name for name in (var, *aliases) if name in os.environ), None)


def apply_device_env(
    device_type: str, deterministic: bool = False, collective_timeout_s: float | None = None
) -> dict[str, str]:
    """Set the runtime environment of this process for `device_type` (`env_defaults`, plus the
    determinism variables on npu); no-op (returns {}) on cpu. Returns the variables it set.

    Must run before the process group is created and before the first device allocation: HCCL
    reads its variables when it builds its communicators, the allocators theirs on first use.
    Defaults never override a variable the user exported (run_train.sh exports the allocator
    settings itself when unset, so they reach every process); job.deterministic forces the
    determinism variables (a run asked to be deterministic must not silently be otherwise).
    """
    defaults = env_defaults(device_type, collective_timeout_s)
    if device_type == "npu":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "apply_device_env('npu') must run before init_distributed: HCCL has already read "
                "its environment (HCCL_DETERMINISTIC, timeouts)"
            )
    applied = {k: v for k, v in defaults.items() if _user_name(k, device_type) is None}
    if deterministic and device_type == "npu":
        applied.update(NPU_DETERMINISTIC_ENV)
    os.environ.update(applied)
    patch_fork_rng(device_type)
    return applied


def describe_env(
    device_type: str, applied: dict[str, str], collective_timeout_s: float | None = None
) -> str:
    """One log line: each variable `env_defaults` manages, its value, and who set it."""
    parts = []
    for var in env_defaults(device_type, collective_timeout_s):
        if var in applied:
            parts.append(f"{var}={applied[var]} (default)")
        else:
            name = _user_name(var, device_type) or var
            parts.append(f"{name}={os.environ.get(name, '')} (yours)")
    for var in NPU_DETERMINISTIC_ENV:
        if var in applied:
            parts.append(f"{var}={applied[var]} (job.deterministic)")
    return ", ".join(parts)


_ORIGINAL_FORK_RNG = torch.random.fork_rng


def patch_fork_rng(device_type: str) -> bool:
    """On npu, make torch.random.fork_rng default to device_type="npu"; no-op elsewhere.

    Why: fork_rng without a device type forks the *CUDA* generator (torch <= 2.12 has no
    accelerator default), and torch.distributed.pipelining calls it without one while inferring
    stage shapes, which fails (or forks the wrong RNG) on Ascend. The Ascend torchtitan port
    patches the same call. Callers that pass device_type are unchanged. Returns True if patched.
    """
    _check_type(device_type)
    if device_type != "npu":
        return False
    if getattr(torch.random.fork_rng, "_engram_npu_default", False):
        return True

    def fork_rng(*args, device_type=None, **kwargs):
        return _ORIGINAL_FORK_RNG(*args, device_type=device_type or "npu", **kwargs)

    fork_rng._engram_npu_default = True  # type: ignore[attr-defined]
    fork_rng.__doc__ = _ORIGINAL_FORK_RNG.__doc__
    torch.random.fork_rng = fork_rng
    return True


def warn_npu_gaps(device_type: str, tp: int, pp: int = 1) -> str | None:
    """Log one warning for the parallelisms torch_npu lists as unvalidated on Atlas A2 / A3 and
    return it (None when there is nothing to say). Call once per run. Pipelining (`pp`) needs no
    warning: its documented gap (fork_rng) is fixed by apply_device_env."""
    _check_type(device_type)
    if device_type != "npu" or tp <= 1:
        return None
    msg = (
        f"parallelism.tp={tp} on npu: torch_npu lists parallelize_module and RowwiseParallel as not "
        "yet validated on Atlas A2 / A3 (910B / 910C); run `scripts/check_cluster.py --tp` on these "
        "nodes first (see docs/npu.md)"
    )
    logging.getLogger("engram").warning(msg)
    return msg
