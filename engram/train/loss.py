"""The training loss, in one place: the recipe's forward-backward, the pipeline's last stage and
held-out evaluation all call one `LanguageModelLoss` (built by `build_loss`).

The loss is the mean token cross-entropy over the valid (label != -100) tokens of a micro-batch,
computed in fp32.

`loss_chunks = 1`: the model returns logits [B, T, V] and the loss reads them.

`loss_chunks = n > 1` (chunked output head): the model returns its final hidden states [B, T, D]
(after the final norm; `Transformer.set_hidden_output`) and the loss applies the output head itself,
to at most n sequence chunks of ceil(T / n) positions, one at a time: chunk -> head -> fp32
logits -> summed cross-entropy / valid tokens of the micro-batch -> autograd.grad into the chunk's
slice of the hidden-state gradient and into the head's parameter gradients (summed over chunks
in the parameter's dtype; a plain bias-free nn.Linear head gets two matmuls per chunk and an
in-place weight-gradient sum instead of autograd). Only one chunk's logits exist at a time.
The chunk loop runs inside one autograd.Function whose inputs are the hidden states and the
head's parameters: its forward runs the loop and keeps the two gradients, its backward hands
them out times the incoming gradient. Hence:
- loss and gradients equal the unchunked ones up to fp32 summation order;
- a loss scale (gradient accumulation, pipeline micro-batches) applies in the backward as for
  any loss, and the gradients reach the model in the ordinary backward pass;
- FSDP2: the head's gradient arrives once per micro-batch, in the unsharded parameter FSDP
  gathered for the forward, and is reduce-scattered once with its unit (no chunk backward runs
  FSDP's hooks); tied embeddings get the head's and the embedding's contributions summed;
- tensor parallel: sequence-sharded hidden states are all-gathered once (as the unchunked head
  does); under loss parallel each chunk's logits stay sharded over the vocabulary;
- forward-only (evaluation, or nothing to train in the head's path): chunks without gradients.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

IGNORE_INDEX = -100


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token loss over the valid labels, in fp32; `logits` [B, T, V] may be vocabulary-sharded
    (TP loss parallel: call it, and the backward, under `LanguageModelLoss.context()`)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX
    )


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the token losses over the valid labels, in fp32 (a chunk's share of the mean)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor (a loss-parallel loss is a replicated DTensor)."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class LanguageModelLoss:
    """`loss(model_output, labels)` -> the micro-batch's mean token loss (see the module doc).

    `head_owner` is the module whose `output` head the chunked path applies (None on pipeline
    ranks without the last stage, or when `chunks` = 1). `sharded_logits`: TP keeps the logits
    sharded over the vocabulary, so the loss and its backward run under loss_parallel()."""

    def __init__(
        self,
        chunks: int,
        head_owner: nn.Module | None,
        sharded_logits: bool,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        if chunks < 1:
            raise ValueError(f"loss chunks must be >= 1, got {chunks}")
        self.chunks = chunks
        self.head_owner = head_owner if chunks > 1 else None
        self.sharded_logits = sharded_logits
        self.cp_group = cp_group
        """Under context parallelism (cp > 1) the ranks that hold the other pieces of the same
        samples: each divides its token sum by the sample's valid tokens / cp, so that the
        gradient mean over dp x cp (FSDP) is the token mean of the whole sequence."""

    def valid_tokens(self, labels: torch.Tensor) -> torch.Tensor:
        """The divisor of the token sum: this micro-batch's valid labels; under cp the whole
        sequence's over cp (one scalar all-reduce)."""
        n = (labels != IGNORE_INDEX).sum()
        if self.cp_group is None:
            return n
        n = n.float()
        dist.all_reduce(n, group=self.cp_group)
        return n / dist.get_world_size(self.cp_group)

    def context(self) -> contextlib.AbstractContextManager:
        """loss_parallel() when TP keeps the logits vocabulary-sharded, else nothing. Enter it
        once around every forward + loss + backward (the recipe wraps its training loop)."""
        return loss_parallel() if self.sharded_logits else contextlib.nullcontext()

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.head_owner is None:
            if self.cp_group is None:
                return cross_entropy(output, labels)
            return summed_cross_entropy(output, labels) / self.valid_tokens(labels)
        owner = self.head_owner
        if isinstance(owner, FSDPModule):
            # Under reshard "always" the root resharded after its forward: gather it again (a
            # no-op when it is unsharded). Its backward reduce-scatters the head's gradient.
            owner.unshard()
        head = owner.output
        params = [p for p in head.parameters() if p.requires_grad]
        if torch.is_grad_enabled() and (output.requires_grad or params):
            return _ChunkedHeadLoss.apply(self, head, labels, output, *params)
        loss, _ = self.chunk_loop(head, output, labels, [], need_grad=False)
        return loss

    def chunk_loop(
        self,
        head: nn.Module,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        params: list[torch.Tensor],
        need_grad: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Loss of the micro-batch and (need_grad) the gradients of [hidden, *params]."""
        h = hidden.detach()
        if isinstance(h, DTensor) and not all(p.is_replicate() for p in h.placements):
            h = h.redistribute(h.device_mesh, [Replicate()] * h.device_mesh.ndim)
        n_valid = self.valid_tokens(labels)
        t = h.shape[1]
        size = -(-t // self.chunks)
        total = torch.zeros((), dtype=torch.float32, device=labels.device)
        grad_h = _ChunkGrads(h) if need_grad and hidden.requires_grad else None
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        linear = _plain_linear(head)
        for start in range(0, t, size):
            labels_c = labels[:, start : start + size]
            if linear is not None:  # same math as below, without a [V, D] temporary per chunk
                chunk = h[:, start : start + size]
                logits = F.linear(chunk, linear).requires_grad_(need_grad)
                loss = summed_cross_entropy(logits, labels_c) / n_valid
                total += loss.detach()
                if not need_grad:
                    continue
                (dlogits,) = torch.autograd.grad(loss, [logits])
                if grad_h is not None:
                    grad_h.put(start, dlogits @ linear)
                if params:
                    if grad_p[0] is None:
                        grad_p[0] = torch.zeros_like(linear)
                    grad_p[0].addmm_(dlogits.flatten(0, 1).T, chunk.flatten(0, 1))
                continue
            chunk = h[:, start : start + size].detach().requires_grad_(grad_h is not None)
            loss = summed_cross_entropy(head(chunk), labels_c) / n_valid
            total += local_value(loss)
            if not need_grad:
                continue
            wanted = ([chunk] if grad_h is not None else []) + list(params)
            grads = list(torch.autograd.grad(loss, wanted))
            if grad_h is not None:
                grad_h.put(start, grads.pop(0))
            for i, g in enumerate(grads):
                grad_p[i] = g if grad_p[i] is None else grad_p[i].add_(g)
        grad_hidden = grad_h.result(hidden) if grad_h is not None else None
        return total, [grad_hidden, *grad_p]


def _plain_linear(head: nn.Module) -> torch.Tensor | None:
    """The detached weight of a bias-free nn.Linear head with plain (not DTensor) weights and no
    hooks, whose chunk gradients the loop computes with two matmuls, accumulating the weight
    gradient in place; None for any other head (TP, adapters, float8), which goes through
    autograd."""
    plain = (
        type(head) is nn.Linear
        and head.bias is None
        and not isinstance(head.weight, DTensor)
        and not (head._forward_hooks or head._forward_pre_hooks)
    )
    return head.weight.detach() if plain else None


class _ChunkGrads:
    """The hidden-state gradient, written chunk by chunk into one buffer (local tensors), then
    given the hidden states' layout (under TP: the chunks' partial sums reduce-scattered)."""

    def __init__(self, h: torch.Tensor) -> None:
        self.local = torch.empty_like(h.to_local() if isinstance(h, DTensor) else h)
        self.placements = None
        self.mesh = None

    def put(self, start: int, g: torch.Tensor) -> None:
        if isinstance(g, DTensor):
            self.mesh, self.placements = g.device_mesh, g.placements
            g = g.to_local()
        self.local[:, start : start + g.shape[1]].copy_(g)

    def result(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.mesh is None:
            return self.local
        full = DTensor.from_local(self.local, self.mesh, self.placements, run_check=False)
        return full.redistribute(hidden.device_mesh, hidden.placements)


def _scaled(g: torch.Tensor | None, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """g * scale in `dtype`; a DTensor keeps its layout (scale is a plain scalar)."""
    if g is None:
        return None
    if isinstance(g, DTensor):
        local = (g.to_local() * scale).to(dtype)
        return DTensor.from_local(
            local, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride()
        )
    return (g * scale).to(dtype)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Forward: the chunk loop (loss, and the gradients of hidden and head params for a unit
    loss gradient). Backward: those gradients times the incoming one. Backward may run twice
    (zero-bubble schedules compute input and weight gradients in separate passes)."""

    @staticmethod
    def forward(ctx, loss_fn: LanguageModelLoss, head, labels, hidden, *params):  # type: ignore[override]
        with torch.enable_grad():
            loss, grads = loss_fn.chunk_loop(head, hidden, labels, list(params), need_grad=True)
        ctx.grads = grads
        ctx.dtypes = [x.dtype for x in (hidden, *params)]
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        if isinstance(grad_loss, DTensor):
            grad_loss = grad_loss.full_tensor()
        grads = [_scaled(g, grad_loss, d) for g, d in zip(ctx.grads, ctx.dtypes, strict=True)]
        return None, None, None, *grads


def build_loss(
    chunks: int,
    model_parts: list[nn.Module],
    sharded_logits: bool,
    cp_group: dist.ProcessGroup | None = None,
) -> LanguageModelLoss:
    """The loss for this rank's model parts. With chunks > 1 the part holding the output head
    (the last pipeline stage) returns hidden states and the loss applies its head. `cp_group`:
    the context-parallel group when cp > 1 (LanguageModelLoss.cp_group)."""
    owner = next((p for p in model_parts if getattr(p, "output", None) is not None), None)
    if chunks > 1 and owner is not None:
        owner.set_hidden_output(True)
    return LanguageModelLoss(chunks, owner, sharded_logits, cp_group)
