"""Process-group start-up: the same code path under torchrun and as a plain `python` process."""

from __future__ import annotations

import gc
import logging
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from engram.runtime.device import dist_backend, local_device


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"RANK is set but {name} is not: launch with torchrun (./run_train.sh), or unset RANK "
            "to run as a single process"
        )
    return int(value)


def init_distributed(device_type: str, timeout_s: float = 1800) -> tuple[int, int, int]:
    """Join (or create) the default process group; return (rank, local_rank, world_size).

    Under torchrun the numbers come from RANK / LOCAL_RANK / WORLD_SIZE (rendezvous via
    MASTER_ADDR / MASTER_PORT). Without torchrun (no RANK) a world-size-1 group is created on a
    free 127.0.0.1 port, so single-process runs use the same collectives and checkpoint code.
    On accelerators the local device is made current first, so NCCL/HCCL bind the right device.
    """
    if dist.is_initialized():
        return dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)), dist.get_world_size()

    backend = dist_backend(device_type)
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:
        if device_type != "cpu":
            local_device(device_type, 0)
        # Port 0: the store binds a free port itself, so there is no probe-then-bind race.
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return 0, 0, 1

    rank, local_rank, world_size = _env_int("RANK"), _env_int("LOCAL_RANK"), _env_int("WORLD_SIZE")
    if device_type != "cpu":
        local_device(device_type, local_rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    return rank, local_rank, world_size


def set_pg_timeouts(timeout_s: float) -> int:
    """Set `timeout_s` on every process group of this rank (the default group, the device
    mesh's groups and any other); returns how many took it.

    After the first training step, as torchtitan does: a barrier first, so no rank issues a
    collective under the new timeout while another still finishes start-up under the old one.
    torch's `_set_pg_timeout` reaches gloo and nccl only; other backends (hccl) keep the
    timeout they were created with (init_process creates them with the longer of the two)."""
    if not dist.is_initialized():
        return 0
    dist.barrier()
    timeout, changed = timedelta(seconds=timeout_s), 0
    for group in list(dist.distributed_c10d._world.pg_map):
        if dist.get_backend(group) not in ("gloo", "nccl"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "only supported for nccl or gloo": filtered above
            dist.distributed_c10d._set_pg_timeout(timeout, group)
        changed += 1
    logging.getLogger("engram").info(
        f"process-group timeout now {timeout_s:g} s on {changed} group(s) (comm.train_timeout_s)"
    )
    return changed


def destroy_distributed() -> None:
    """Tear down all process groups if they exist (safe to call twice).

    FSDP's parameter groups (and the modules around them) sit in reference cycles that hold the
    C++ process groups; left to the interpreter's shutdown, gloo's teardown of them there
    aborted about 1 in 20 two-node CPU runs after the last step ("terminate called without an
    active exception", exit -6). Collecting the cycles first lets destroy_process_group free the
    groups while the interpreter is fully alive."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def shard_groups(t: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """Process groups over which a tensor's local pieces must be summed for a global sum (a
    gradient norm): its Shard dims, including the _StridedShard that FSDP2 puts over a
    TP-sharded dim (not a Shard subclass); () for a plain tensor. Replicate dims hold copies
    (counted once); a pending Partial sum is refused: bring the tensor to its parameter's
    placements first."""
    if not isinstance(t, DTensor):
        return ()
    mesh = t.device_mesh
    groups = []
    for i, pl in enumerate(t.placements):
        if isinstance(pl, (Shard, _StridedShard)):
            groups.append(mesh.get_group(i))
        elif not isinstance(pl, Replicate):
            raise ValueError(f"cannot take the norm of a tensor with placements {t.placements}")
    return tuple(groups)


def placed_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's rows of a row-sharded table) as a tensor placed like table `p`: a
    DTensor on p's mesh and placements, its global rows p's (a plain tensor stays as it is)."""
    if not isinstance(p, DTensor):
        return local
    shape = (p.shape[0], *local.shape[1:])
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=shape, stride=local.stride()
    )
