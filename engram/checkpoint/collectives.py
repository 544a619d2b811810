"""The few collectives checkpointing needs, each also correct without a process group
(one process: rank 0 of 1), so save, load and verification run the same code alone."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from engram.checkpoint.errors import CheckpointError


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_from_rank0(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def raise_if_any_rank_failed(error: str | None) -> None:
    """Collective: every rank raises the first rank's error, so no rank waits forever."""
    errors = [e for e in all_gather_objects(error) if e]
    if errors:
        raise CheckpointError(errors[0])
