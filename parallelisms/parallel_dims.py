"""Parallel degrees -> one validated, named DeviceMesh.

Mesh dimensions (always present, size 1 where unused, so world size 1 runs the same code path):

    dp_replicate  replicas of the model (DDP across them; HSDP when dp_shard > 1 too)
    dp_shard      FSDP2 shard group

Derived (flattened) dimensions:

    dp            all data-parallel ranks (dp_replicate x dp_shard): the data loader's rank space
    engram        the axis the Engram tables are row-sharded over (= dp: every data-parallel rank
                  holds 1/dp of every table; no rank ever holds a whole table)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engram.config import ConfigError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallelism.{name} must be >= 1, got {getattr(self, name)}")
        if self.tp != 1:
            raise ConfigError(
                f"parallelism.tp={self.tp}: tensor parallelism is not supported yet; set parallelism.tp=1"
            )
        if self.pp != 1:
            raise ConfigError(
                f"parallelism.pp={self.pp}: pipeline parallelism is not supported yet; set parallelism.pp=1"
            )
        others = self.dp_replicate * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by dp_replicate({self.dp_replicate}) x "
                    f"tp({self.tp}) x pp({self.pp}) = {others}; change those degrees or the number of processes"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ConfigError(f"parallelism.dp_shard must be >= 1 or -1, got {self.dp_shard}")
        product = others * self.dp_shard
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees do not multiply to the world size: dp_replicate({self.dp_replicate}) x "
                f"dp_shard({self.dp_shard}) x tp({self.tp}) x pp({self.pp}) = {product}, but "
                f"{self.world_size} processes were launched; set parallelism.dp_shard=-1 to use the rest, "
                f"or launch {product} processes (NGPU x NNODES)"
            )

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (FSDP2 / HSDP)."""
        return self.dp_shard > 1

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication: every rank holds full dense weights, gradients are all-reduced."""
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the meshes once (collective: every rank must call it); returns the world mesh."""
        if not self._meshes:
            world = init_device_mesh(
                device_type,
                (self.dp_replicate, self.dp_shard),
                mesh_dim_names=("dp_replicate", "dp_shard"),
            )
            # Flattened meshes are kept here: slicing them back out of the root mesh is deprecated.
            self._meshes = {
                "world": world,
                "dp_replicate": world["dp_replicate"],
                "dp_shard": world["dp_shard"],
                "dp": world["dp_replicate", "dp_shard"]._flatten("dp"),
                "engram": world["dp_replicate", "dp_shard"]._flatten("engram"),
            }
        return self._meshes["world"]

    def mesh(self, name: str = "world") -> DeviceMesh:
        """world | dp_replicate | dp_shard | dp | engram (after build_mesh)."""
        if not self._meshes:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must be called first")
        return self._meshes[name]


def parallel_dims_from_config(cfg, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    return ParallelDims(
        dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, world_size=world_size
    )
