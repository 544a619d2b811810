"""Parallel degrees -> one validated, named DeviceMesh.

Mesh dimensions (always present, size 1 where unused, so world size 1 runs the same code path),
outermost first:

    pp            pipeline stages (parallelisms/pipeline.py; each stage has its own dp x tp)
    dp_replicate  replicas of the model (DDP across them; HSDP when dp_shard > 1 too)
    dp_shard      FSDP2 shard group
    cp            context parallel group: the ranks that split one sample's sequence
    tp            tensor parallel group (innermost: neighbouring ranks, i.e. within a node)

The order is torchtitan's (pp, dp_replicate, dp_shard, cp, tp).

Flattened views:

    dp            all data-parallel ranks (dp_replicate x dp_shard): the data loader's rank space
                  (the cp ranks of a replica read the same sample and split it)
    dp_shard_cp   FSDP2's shard group (dp_shard x cp): cp ranks shard parameters like dp ranks
                  (torchtitan's dp_shard_cp)
    fsdp          FSDP2's mesh: dp_shard_cp, or (dp_replicate, dp_shard_cp) for HSDP / DDP; of
                  size 1 without data parallelism, where FSDP2 still casts to the compute dtype
    dp_cp         every rank that holds other tokens (dp x cp): the logged loss's mean
    cp_tp         the ranks that hold consecutive pieces of one sample's sequence: the Engram
                  ShortConv's halo exchange (parallelisms/halo.py)
    engram        the axis the Engram tables are row-sharded over: every rank of a pipeline stage
                  (dp_replicate x dp_shard x cp x tp), so each rank holds 1 / (dp x cp x tp) of
                  every table

What each axis divides is stated once, in `axis_divisors` (read by `check_model` and the memory
planner). Degrees are checked here once (`__post_init__`); the checks that need the model's shape
(tp must divide heads, FFN width, vocabulary, sequence) are in `check_model`, which
parallelize_model calls before touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engram.config import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened views (module docstring) -> the mesh dims they span, outermost first.
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "cp_tp": ("cp", "tp"),
    "engram": ("dp_replicate", "dp_shard", "cp", "tp"),
}


@dataclass(frozen=True)
class AxisDivisors:
    """What one rank of a pipeline stage holds of each quantity: the whole divided by these."""

    stream_tokens: int
    """Residual-stream tokens (norms, checkpointed layer inputs, pipeline sends): cp x tp under
    sequence parallel (Shard(1)), else cp (replicated over tp)."""
    engram_tokens: int
    """Tokens an Engram block processes and looks up (its activations, its table all-to-all):
    cp x tp in both TP modes (tensor_parallel.SequenceShardedEngram splits a replicated stream)."""
    attention_tokens: int
    """Query tokens of the attention kernel: cp (Ulysses gathers the whole sequence for
    heads / cp; all-gather K/V keeps its queries but holds every key and value)."""
    heads: int
    """Attention heads and KV heads (column-parallel q / k / v): tp; in the attention kernel
    tp x cp under Ulysses (all-to-all to head shards), tp under all-gather K/V."""
    ffn_width: int
    """FFN hidden width (column-parallel w1 / w3): tp."""
    vocab: int
    """Embedding rows, output-head columns and, with loss parallel, the logits: tp."""
    table_rows: int
    """Rows of each Engram table (the "engram" mesh): dp x cp x tp."""


def axis_divisors(
    tp: int, sequence_parallel: bool, dp: int = 1, cp: int = 1, cp_method: str = "ulysses"
) -> AxisDivisors:
    """The one statement of what the tp, cp and dp axes divide (parallelisms/tensor_parallel.py,
    context_parallel.py and engram_tables/ implement it; check_model and the planner read it).
    cp divides every token count (stream, Engram, queries) and the table rows, and, under
    Ulysses only, the heads inside the attention kernel."""
    return AxisDivisors(
        stream_tokens=cp * (tp if sequence_parallel else 1),
        engram_tokens=cp * tp,
        attention_tokens=cp,
        heads=tp * (cp if cp_method == "ulysses" else 1),
        ffn_width=tp,
        vocab=tp,
        table_rows=dp * cp * tp,
    )


def cp_chunks(cp_rank: int, cp: int, load_balanced: bool) -> list[int]:
    """The one statement of how context parallelism cuts a sequence: the chunk indices cp rank
    `cp_rank` holds, in its local order (the order of its tokens, chunk_positions, and of its
    halo pieces, sequence_pieces). Contiguous: cp equal chunks, rank c holds chunk c.
    Load-balanced (allgather_kv, ParallelDims.cp_load_balanced): 2 x cp chunks, rank c holds
    chunks c and 2 cp - 1 - c, so that every rank's share of the causal attention work is even."""
    return [cp_rank, 2 * cp - 1 - cp_rank] if load_balanced else [cp_rank]


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    sequence_parallel: bool = True
    """Under TP: the residual stream (norms, checkpointed layer inputs) is sharded along the
    sequence; Engram blocks are in both modes (axis_divisors)."""
    cp: int = 1
    cp_method: str = "ulysses"
    """ulysses | allgather_kv (engram/config/parallelism.py)."""
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallelism.{name} must be >= 1, got {getattr(self, name)}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by dp_replicate({self.dp_replicate}) x "
                    f"cp({self.cp}) x tp({self.tp}) x pp({self.pp}) = {others}; change those "
                    "degrees or the number of processes"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ConfigError(f"parallelism.dp_shard must be >= 1 or -1, got {self.dp_shard}")
        product = others * self.dp_shard
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees do not multiply to the world size: pp({self.pp}) x "
                f"dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x cp({self.cp}) "
                f"x tp({self.tp}) = "
                f"{product}, but {self.world_size} processes were launched; set "
                f"parallelism.dp_shard=-1 to use the rest, or launch {product} processes (NGPU x NNODES)"
            )

    def check_model(self, args, seq_len: int, engram_halo: int = 0) -> None:
        """Errors naming the fix when tp or cp does not fit the model (`args`: ModelArgs).

        `engram_halo`: the ShortConv's causal reach ((kernel_size - 1) x dilation), which every
        rank's sequence piece must cover (0 without Engram).
        """
        if self.tp > 1:
            self._check_tp(args, seq_len, engram_halo)
        if self.cp > 1:
            self._check_cp(args, seq_len, engram_halo)

    def _check_tp(self, args, seq_len: int, engram_halo: int) -> None:
        tp, d = self.tp, axis_divisors(self.tp, self.sequence_parallel)
        for what, n, div, fix in (
            (
                "n_heads",
                args.n_heads,
                d.heads,
                "choose a tp that divides the number of attention heads",
            ),
            (
                "n_kv_heads",
                args.n_kv_heads,
                d.heads,
                "choose a tp that divides the number of KV heads",
            ),
            ("ffn_dim", args.ffn_dim, d.ffn_width, "choose a tp that divides the FFN hidden width"),
            ("vocab_size", args.vocab_size, d.vocab, "pad model.vocab_size to a multiple of tp"),
        ):
            if n % div:
                raise ConfigError(f"parallelism.tp={tp} does not divide {what}={n}: {fix}")
        if args.tie_embeddings:
            raise ConfigError(
                "tied input/output embeddings are not supported under tensor parallelism "
                "(the embedding is row-sharded, the output head column-sharded): set parallelism.tp=1"
            )
        split = max(d.stream_tokens, d.engram_tokens if engram_halo else 1)
        if seq_len % split:
            raise ConfigError(
                f"training.seq_len={seq_len} is not divisible by parallelism.tp={tp}: sequence "
                "parallelism and the Engram blocks split the sequence over TP ranks; choose a "
                "seq_len that is a multiple of tp"
            )
        if engram_halo and seq_len // d.engram_tokens < engram_halo:
            raise ConfigError(
                f"training.seq_len={seq_len} over tp={tp} gives {seq_len // tp} tokens per TP rank, "
                f"fewer than the Engram ShortConv's reach of {engram_halo} positions "
                "((kernel_size - 1) x max_ngram): use a longer seq_len or a smaller tp"
            )

    def _check_cp(self, args, seq_len: int, engram_halo: int) -> None:
        cp, tp, method = self.cp, self.tp, self.cp_method
        heads = self.divisors.heads
        if method == "ulysses":
            for what, n in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)):
                if n % heads:
                    raise ConfigError(
                        f"parallelism.cp_method=ulysses exchanges attention heads: {what}={n} is "
                        f"not divisible by tp x cp = {tp} x {cp}; choose a cp (and tp) whose "
                        "product divides both head counts, or set parallelism.cp_method="
                        '"allgather_kv" (any head count)'
                    )
        # Pieces: the cp_chunks, each split over tp (parallelisms/halo.py).
        pieces = self.cp_chunk_count * tp
        if seq_len % pieces:
            why = " x 2 (load-balanced chunks)" if self.cp_load_balanced else ""
            raise ConfigError(
                f"training.seq_len={seq_len} is not divisible by cp({cp}) x tp({tp}){why} = "
                f"{pieces}: context parallelism splits each sequence into that many equal "
                "pieces; choose a seq_len that is a multiple of it"
            )
        if engram_halo and seq_len // pieces < engram_halo:
            raise ConfigError(
                f"training.seq_len={seq_len} in {pieces} pieces under cp={cp} (tp={tp}, "
                f"{method}) gives {seq_len // pieces} tokens per piece, fewer than the Engram "
                f"ShortConv's reach of {engram_halo} positions ((kernel_size - 1) x max_ngram) "
                "that a piece takes from its predecessor: use a longer seq_len or a smaller cp"
            )

    @property
    def cp_load_balanced(self) -> bool:
        """Whether the sequence is cut into load-balanced chunks (cp_chunks): under allgather_kv,
        whose ranks each attend their own queries; Ulysses gives every rank the whole sequence
        of its heads, so contiguous chunks are already balanced."""
        return self.cp_method == "allgather_kv"

    @property
    def cp_chunk_count(self) -> int:
        """Chunks a sequence is cut into over the cp ranks (cp_chunks): cp, or 2 x cp."""
        return self.cp * len(cp_chunks(0, self.cp, self.cp_load_balanced))

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def divisors(self) -> AxisDivisors:
        return axis_divisors(self.tp, self.sequence_parallel, self.dp_size, self.cp, self.cp_method)

    @property
    def engram_size(self) -> int:
        """Ranks each Engram table is row-sharded over (dp x cp x tp of one pipeline stage)."""
        return self.divisors.table_rows

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP2 shards parameters over (dp_shard x cp) and averages gradients over
        (dp_replicate x dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (FSDP2 / HSDP; cp ranks shard like dp_shard ranks)."""
        return self.fsdp_size > 1

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication: every rank holds full dense weights, gradients are all-reduced."""
        return self.dp_replicate > 1 and self.fsdp_size == 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the meshes once (collective: every rank must call it); returns the world mesh."""
        if not self._meshes:
            world = init_device_mesh(
                device_type,
                (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                mesh_dim_names=MESH_DIMS,
            )
            # Flattened meshes are kept here: slicing them back out of the root mesh is deprecated.
            self._meshes = {
                "world": world,
                **{name: world[name] for name in MESH_DIMS},
                **{name: world[dims]._flatten(name) for name, dims in FLATTENED.items()},
            }
            # FSDP2's mesh: HSDP's 2-D (dp_replicate, dp_shard_cp), built from the kept views
            # (slicing a flattened dim out of the root mesh is deprecated), else 1-D.
            self._meshes["fsdp"] = (
                DeviceMesh._concatenate([self._meshes["dp_replicate"], self._meshes["dp_shard_cp"]])
                if self.dp_replicate > 1
                else self._meshes["dp_shard_cp"]
            )
        return self._meshes["world"]

    def mesh(self, name: str = "world") -> DeviceMesh:
        """world | pp | dp_replicate | dp_shard | cp | tp | dp | dp_shard_cp | dp_cp | cp_tp |
        engram | fsdp (after build_mesh)."""
        if not self._meshes:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must be called first")
        return self._meshes[name]


def parallel_dims_from_config(cfg, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    return ParallelDims(
        dp_replicate=p.dp_replicate,
        dp_shard=p.dp_shard,
        tp=p.tp,
        pp=p.pp,
        world_size=world_size,
        sequence_parallel=p.tp_sequence_parallel,
        cp=p.cp,
        cp_method=p.cp_method,
    )
