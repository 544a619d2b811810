"""Tensor parallelism: `apply_tp(model, tp_mesh, ...)`, a plan keyed by module name.

Backbone (Megatron / torchtitan layout): q/k/v and gate/up (w1/w3) column-wise, o and down (w2)
row-wise; Qwen2's q/k/v biases shard with their columns; Qwen3's per-head q/k norms see a slice
of the heads and keep replicated weights (their gradients are summed over TP by DTensor). The
token embedding is vocabulary-parallel, the output head column-wise; with loss parallel the
logits stay sharded over the vocabulary (`Shard(-1)`) and the recipe computes the loss under
`loss_parallel()`. With sequence parallel the residual stream between blocks is sharded along
the sequence ([B, T/tp, D] per rank) and the norms run on that shard.

Engram blocks run sequence-sharded in both modes (see docs/architecture.md, "Engram under TP"):
each TP rank looks up only its own tokens' hash ids (sliced from the loader's full-sequence ids),
the causal ShortConv receives the `(kernel_size - 1) x dilation` positions before its chunk from
the previous TP rank (parallelisms/halo.py, shared with context parallelism), and the dense Engram parameters stay plain replicated tensors whose
gradients are summed over TP in the backward. Without sequence parallel the block's input is
split and its output all-gathered around it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.utils.stateless import _reparametrize_module

from engram.models.engram import EngramBlock
from engram.models.transformer import Transformer, unwrap_block
from parallelisms.halo import sequence_pieces, split_short_conv, swap_class


def apply_tp(
    model: Transformer,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
) -> None:
    """Shard `model` (built on meta or materialised) over the 1-D `tp_mesh` in place.

    Check the degrees first with ParallelDims.check_model (heads, KV heads, FFN width, vocabulary
    and sequence length must divide by tp; tied embeddings are refused there).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs the 1-D 'tp' mesh, got {tp_mesh.mesh_dim_names}")
    if model.args.tie_embeddings:
        raise ValueError("apply_tp: tied embeddings are not supported under tensor parallelism")
    # Layout of the residual stream between blocks: sequence-sharded (SP) or replicated.
    stream = Shard(1) if sequence_parallel else Replicate()
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    # A pipeline stage holds the embedding / final norm / head only on the first / last stage.
    root_plan = {k: v for k, v in root_plan.items() if getattr(model, k) is not None}
    parallelize_module(model, tp_mesh, root_plan)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_stream_own_storage)

    for layer in model.layers.values():
        block = unwrap_block(layer)
        plan = {
            "attention": PrepareModuleInput(
                # (x, cos, sin, decode cache): Attention.forward's positional inputs
                input_layouts=(stream, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
                use_local_output=True,
            ),
            "attention.wq": Colwise(),
            "attention.wk": Colwise(),
            "attention.wv": Colwise(),
            "attention.wo": Rowwise(output_layouts=stream),
            "feed_forward": PrepareModuleInput(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
            "feed_forward.w1": Colwise(),
            "feed_forward.w2": Rowwise(output_layouts=stream),
            "feed_forward.w3": Colwise(),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        if block.attention.q_norm is not None:
            # Per-head norms see this rank's heads (dim 2 of [B, T, heads, head_dim]).
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        if block.engram is not None:
            _shard_engram_sequence(block.engram, tp_mesh, sequence_parallel)


# ----------------------------------------------------------------------------- LoRA adapters


def _place_adapters(module: nn.Module, mesh: DeviceMesh, partition, placements: dict) -> None:
    """Run the base style's `partition` on the weight / bias alone, then distribute the LoRA
    adapters (engram/models/lora.py) with `placements` (name -> placement)."""
    adapters = {n: module._parameters.pop(n) for n in placements if n in module._parameters}
    partition(module)
    for name, p in adapters.items():
        dist_p = distribute_tensor(p, mesh, [placements[name]])
        module.register_parameter(name, nn.Parameter(dist_p, requires_grad=p.requires_grad))


class Colwise(ColwiseParallel):
    """ColwiseParallel whose LoRA adapters follow the base layer: A [r, in] replicated (it reads
    the whole replicated input), B [out, r] sharded like the output (Shard(0))."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _place_adapters(
            module,
            device_mesh,
            lambda m: super(Colwise, self)._partition_linear_fn(name, m, device_mesh),
            {"lora_A": Replicate(), "lora_B": Shard(0)},
        )


class Rowwise(RowwiseParallel):
    """RowwiseParallel whose LoRA adapters follow the base layer: A [r, in] sharded like the input
    (Shard(1)), B [out, r] replicated; the adapter output is a partial sum like the base output
    and is reduced with it."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _place_adapters(
            module,
            device_mesh,
            lambda m: super(Rowwise, self)._partition_linear_fn(name, m, device_mesh),
            {"lora_A": Shard(1), "lora_B": Replicate()},
        )


def _stream_own_storage(_module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output is `to_local()` of a DTensor: a view of its local tensor made by a
    custom autograd Function. A compiled block that takes such a view as input loses its
    gradient (measured on torch 2.13, aot_eager: the embedding's gradient was zero under FSDP2 x
    TP2, and without FSDP DTensor's redistribute backward received a plain tensor). A copy gives
    the residual stream its own storage; it costs one [B, T/tp, D] copy per micro-batch."""
    return output.clone()


# ----------------------------------------------------------------------------- Engram under TP


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over the TP group.

    For a parameter replicated over TP that each rank applies to different tokens: the full
    gradient is the sum of the per-rank contributions.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _split_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Replicated [B, T, ...] -> this rank's [B, T/tp, ...]; the backward all-gathers."""
    return (
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        .redistribute(mesh, [Shard(1)])
        .to_local()
    )


def _gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's [B, T/tp, ...] -> replicated [B, T, ...]; the (replicated) gradient is sliced."""
    return (
        DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        .redistribute(mesh, [Replicate()])
        .to_local(grad_placements=[Replicate()])
    )


class SequenceShardedEngram(nn.Module):
    """Mixin put in front of an EngramBlock's class by apply_tp (the block keeps its math).

    hidden: this rank's [B, T/tp, D] (sequence parallel) or the replicated [B, T, D];
    hash_ids: the full-sequence [B, T, H] from the loader, sliced to this rank's tokens here.
    """

    _tp_mesh: DeviceMesh
    _tp_sequence_parallel: bool

    def local_ids(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """This TP rank's tokens of the full-sequence [B, T, H]: its T / tp positions (what its
        table looks up; host-table prefetch asks the same, parallelisms/table_prefetch.py)."""
        mesh = self._tp_mesh
        t = hash_ids.shape[1] // mesh.size()
        return hash_ids.narrow(1, mesh.get_local_rank() * t, t)

    def forward(
        self, hidden: torch.Tensor, hash_ids: torch.Tensor, cache=None, doc_positions=None
    ) -> torch.Tensor:
        """`doc_positions` [B, T] (packed documents): sliced to this rank's tokens like the ids."""
        if cache is not None:
            raise ValueError("incremental decoding (a decode cache) runs on an unsharded model")
        mesh = self._tp_mesh
        if not self._tp_sequence_parallel:
            hidden = _split_sequence(hidden, mesh)
        t = hidden.shape[1]
        if hash_ids.shape[1] != t * mesh.size():
            raise ValueError(
                f"Engram under TP expects full-sequence hash_ids (T = {t * mesh.size()}), got "
                f"shape {tuple(hash_ids.shape)}"
            )
        ids = self.local_ids(hash_ids)
        group = mesh.get_group()
        # Dense parameters (not the table, which has its own all-to-all) see only this rank's
        # tokens: sum their gradients over TP.
        dense = {
            name: _SumGradOverTP.apply(p, group)
            for name, p in self.named_parameters()
            if p.requires_grad and not name.startswith("table.")
        }
        with _reparametrize_module(self, dense):
            if doc_positions is not None:
                doc_positions = self.local_ids(doc_positions)
            out = EngramBlock.forward(self, hidden, ids, None, doc_positions)
        return out if self._tp_sequence_parallel else _gather_sequence(out, mesh)


def _shard_engram_sequence(block: EngramBlock, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    if isinstance(block, SequenceShardedEngram):
        raise ValueError("apply_tp was already applied to this Engram block")
    if block.hc_mult != 1:
        raise ValueError("Engram under TP supports hc_mult = 1 only")
    swap_class(block, SequenceShardedEngram)
    block._tp_mesh = mesh
    block._tp_sequence_parallel = sequence_parallel
    # Under context parallelism apply_context_parallel re-targets it to the cp x tp pieces.
    split_short_conv(block.short_conv, mesh, sequence_pieces(1, mesh.size(), False))
