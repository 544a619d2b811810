"""Every rank's numbers from one built rank per pipeline stage: DTensor's own placement math
(what to_local() shapes come from), evaluated at the other ranks' mesh coordinates."""

from __future__ import annotations

import functools
import itertools
import math

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from parallelisms.parallel_dims import FLATTENED, ParallelDims
from planner.measure import is_in, table_layers
from planner.results import AllRanks


def _local_shapes_by_rank(p: DTensor, world: _WorldMesh) -> dict[int, tuple[int, ...]]:
    """Global rank -> local shape of `p` on that rank, for every rank of the world: p's mesh is
    one rank's slice of the world mesh (e.g. its tp or dp_shard group); every other rank holds
    the shape of its own coordinate along the same named dims."""
    mesh = p.device_mesh
    shapes = _local_shapes(tuple(p.shape), tuple(mesh.shape), tuple(p.placements))
    coords = world.coords(tuple(mesh.mesh_dim_names), tuple(mesh.shape))
    return {rank: shapes[flat] for rank, flat in coords}


class _WorldMesh:
    """The world mesh's ranks, read once (DeviceMesh.mesh rebuilds its tensor on every access,
    which dominated a 64-rank plan), with each sub-mesh's (rank, coordinate) pairs memoised."""

    def __init__(self, world_mesh) -> None:
        ranks = world_mesh.mesh
        self.shape = tuple(ranks.shape)
        self.names = world_mesh.mesh_dim_names
        self.ranks = [int(r) for r in ranks.flatten().tolist()]  # row-major, as product() walks
        self._coords: dict[tuple, list[tuple[int, int]]] = {}

    def coords(self, names: tuple[str, ...], sizes: tuple[int, ...]) -> list[tuple[int, int]]:
        """(global rank, row-major index of its coordinate in a mesh of these named dims)."""
        key = (names, sizes)
        if key not in self._coords:
            out = []
            for rank, idx in zip(
                self.ranks, itertools.product(*(range(n) for n in self.shape)), strict=True
            ):
                flat = 0
                for name, size in zip(names, sizes, strict=True):
                    coord = 0
                    for part in FLATTENED.get(name, (name,)):
                        i = self.names.index(part)
                        coord = coord * self.shape[i] + idx[i]
                    flat = flat * size + coord
                out.append((rank, flat))
            self._coords[key] = out
        return self._coords[key]


@functools.cache
def _local_shapes(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple
) -> list[tuple[int, ...]]:
    coords = itertools.product(*(range(n) for n in mesh_shape))
    return [
        _compute_local_shape_and_global_offset(shape, mesh_shape, list(c), placements, True)[0]
        for c in coords
    ]


def stage_ranks_summary(
    parts: list[nn.Module], table_params: list[nn.Parameter], dims: ParallelDims
) -> tuple[dict[int, int], dict[int, dict[int, int]]]:
    """(rank -> dense parameters, layer -> {rank -> table rows}) for every rank that holds the
    same pipeline stages as the current one, from its placements: those ranks differ only in
    their dp / tp coordinates (without PP: every rank of the world)."""
    world_mesh = dims.mesh()
    pp_coord = dims.mesh("pp").get_local_rank()
    same_stage = {int(r) for r in world_mesh.mesh[pp_coord].flatten()}
    world = _WorldMesh(world_mesh)
    dense = dict.fromkeys(same_stage, 0)
    for part in parts:
        for p in part.parameters():
            if is_in(p, table_params):
                continue
            if not isinstance(p, DTensor):  # no FSDP / TP: every rank of the stage holds it whole
                dense = {r: n + p.numel() for r, n in dense.items()}
                continue
            for rank, shape in _local_shapes_by_rank(p, world).items():
                if rank in same_stage:
                    dense[rank] += math.prod(shape)
    rows = {}
    for layer, p in table_layers(parts, table_params):
        if isinstance(p, DTensor):
            by_rank = _local_shapes_by_rank(p, world)
            rows[layer] = {r: by_rank[r][0] for r in same_stage}
        else:
            rows[layer] = dict.fromkeys(same_stage, p.shape[0])
    return dense, rows


def all_ranks_summary(
    summaries: list[tuple[dict[int, int], dict[int, dict[int, int]]]], dims: ParallelDims
) -> AllRanks:
    """Merge the stage summaries (one built rank per pp coordinate) into every rank's numbers."""
    world = dims.world_size
    dense = [0] * world
    rows: dict[int, list[int]] = {}
    for stage_dense, stage_rows in summaries:
        for r, n in stage_dense.items():
            dense[r] += n
        for layer, by_rank in stage_rows.items():
            per_rank = rows.setdefault(layer, [0] * world)
            for r, n in by_rank.items():
                per_rank[r] += n
    rows = dict(sorted(rows.items()))
    return AllRanks(world, dims.dp_replicate, sum(dense), min(dense), max(dense), rows)
