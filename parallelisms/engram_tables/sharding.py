"""apply_engram_table_sharding: the table sharding step of parallelize_model. Each Engram table
becomes a Shard(0) DTensor over the "engram" mesh and its class gains the device lookup
(lookup.py), the host-resident one (host.py) or the NVMe-resident one (nvme.py), by
engram.table_location."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from engram.config.table_locations import TABLE_LOCATIONS, table_location_spec
from engram.rowstore.interface import RowStore
from engram.rowstore.memory import DeviceRowStore, HostRowStore
from engram.rowstore.nvme_store import NvmeRowStore
from parallelisms.engram_tables.host import HostShardedEngramTable
from parallelisms.engram_tables.lookup import ShardedEngramTable
from parallelisms.engram_tables.nvme import NvmeSettings, NvmeShardedEngramTable
from parallelisms.engram_tables.routing import LookupSettings, local_row_range

__all__ = ["LOCATION_BACKENDS", "apply_engram_table_sharding"]

# One table class and row store per engram.table_location (engram/config/table_locations.py).
LOCATION_BACKENDS: dict[str, tuple[type, type[RowStore]]] = {
    "device": (ShardedEngramTable, DeviceRowStore),
    "host": (HostShardedEngramTable, HostRowStore),
    "nvme": (NvmeShardedEngramTable, NvmeRowStore),
}
if tuple(LOCATION_BACKENDS) != TABLE_LOCATIONS:
    raise ImportError(
        f"table backends {tuple(LOCATION_BACKENDS)} differ from engram/config/table_locations.py "
        f"{TABLE_LOCATIONS}: add a location and its backend together"
    )

_SHARDED_CLASSES: dict[tuple[type, str], type] = {}


def _sharded_class(cls: type, location: str) -> type:
    if (cls, location) not in _SHARDED_CLASSES:
        mixin = LOCATION_BACKENDS[location][0]
        name = mixin.__name__.replace("EngramTable", "") + cls.__name__
        _SHARDED_CLASSES[(cls, location)] = type(name, (mixin, cls), {})
    return _SHARDED_CLASSES[(cls, location)]


def _default_table_types() -> tuple[type, ...]:
    from engram.models.engram import EngramTable  # lazy: keeps this module importable on its own

    return (EngramTable,)


def apply_engram_table_sharding(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    grad_scale: float,
    dedup: bool = True,
    row_sparse: bool = False,
    table_types: tuple[type, ...] | None = None,
    wire_dtype: torch.dtype | None = None,
    location: str = "device",
    nvme: NvmeSettings | None = None,
) -> list[nn.Parameter]:
    """Row-shard every Engram table of `model` over the 1-D `mesh`; return the table params.

    Each table's `weight` becomes `nn.Parameter(DTensor)` with Shard(0) (works on the meta device;
    a materialised weight is sliced to the local rows) and its forward becomes the all-to-all
    lookup. `grad_scale` multiplies the table gradient the owners receive (the sum over the
    ranks that looked the rows up): 1 when each rank's loss is its share of the step's token
    mean (engram/train/loss.py; parallelize_model's shard_engram_tables), 1 / W where each of
    W ranks differentiates its own local mean and the mean over them is wanted.
    `row_sparse`: the backward leaves row-sparse gradients for a row-sparse optimizer
    (engram/config/table_optimizers.py) instead of a dense gradient. The returned list is in module
    order (identical on every rank): pass it to `fully_shard(..., ignored_params=...)` and give
    it its own optimizer group. `table_types` defaults to engram.models.engram.EngramTable.
    `wire_dtype`: dtype of the rows and row gradients in the all-to-all (None: the table's).
    `location`: "device" | "host" (engram.table_location): a host table keeps its shard in host
    memory and looks up through a host gather (host.py); which table optimizers a location
    supports is engram/config/table_locations.py. "nvme": the shard and its optimizer state in
    page files with a host cache (nvme.py), as `nvme` says (its cache_bytes_per_table is the
    rank's budget, split here over the tables).
    """
    if location == "nvme" and nvme is None:
        raise ValueError("table_location = nvme needs its NvmeSettings (dirs, host cache)")
    if table_location_spec(location).row_sparse_only and not row_sparse:
        raise ValueError(
            f"Engram tables at table_location = {location} need row_sparse=True (a row-sparse "
            f"table optimizer: {' or '.join(table_location_spec(location).optimizers())})"
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"Engram tables shard over a 1-D mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}: "
            "pass the 'engram' sub-mesh, e.g. world_mesh['engram']"
        )
    types = table_types if table_types is not None else _default_table_types()
    world, rank = mesh.size(), mesh.get_local_rank()
    settings = LookupSettings(mesh.get_group(), dedup, float(grad_scale), wire_dtype, row_sparse)
    params: list[nn.Parameter] = []
    for module in model.modules():
        if not isinstance(module, types):
            continue
        if isinstance(module, ShardedEngramTable):
            raise ValueError(f"{type(module).__name__} is already sharded: apply the sharding once")
        weight = module.weight
        if weight.dim() != 2:
            raise ValueError(f"Engram table weight must be [rows, dim], got {tuple(weight.shape)}")
        start, stop = local_row_range(weight.shape[0], rank, world)
        local = weight.detach()[start:stop].clone()  # on meta this allocates nothing
        dt = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=weight.stride()
        )
        module.weight = nn.Parameter(dt, requires_grad=weight.requires_grad)
        module.__class__ = _sharded_class(type(module), location)
        module.set_lookup(settings)
        params.append(module.weight)
    if location == "nvme":
        tables = [(n, m) for n, m in model.named_modules() if isinstance(m, NvmeShardedEngramTable)]
        share = dataclasses.replace(
            nvme, cache_bytes_per_table=nvme.cache_bytes_per_table // len(tables)
        )
        for name, table in tables:
            table.set_nvme(share, label=name)
    return params
