"""The training loss, in one place: the recipe's forward-backward, the pipeline's last stage,
the DeepSpeed engine's step and held-out evaluation all call one `LanguageModelLoss` (built by
`build_loss`), and all divide by one rule, `TargetTokens`.

The loss is the token mean of the whole optimizer step: the sum of the cross-entropies (fp32) of
every target token (label != -100) of the step, over every micro-batch, data-parallel rank,
context-parallel piece and pipeline micro-batch, divided by ONE count of those tokens
(`TargetTokens.count`: this rank's count over the step's micro-batches, all-reduced once over the
ranks that hold other tokens, dp x cp, before the first backward; TP ranks hold the same labels
and pipeline stages read them from the same batch, so neither joins it). Each micro-batch's loss
is its token sum / that count, so the gradients of all of them together are SUMMED, never
averaged: FSDP2 / HSDP / DDP reduce by sum (parallelisms/fsdp.py), the Engram tables' owners take
the sum of the lookups' gradients (grad_scale 1, parallelisms/parallelize.py), the pipeline
schedule does not rescale (scale_grads=False), and the DeepSpeed step undoes the engine's own
mean over dp (runner/engine_step.py). A mean of per-micro-batch means would weigh a token of a
micro-batch with few targets (short answers of a prompt-masked chat set) more than one with many;
with the step's count every layout and accumulation trains the same objective. Plain packed text
has the same count in every micro-batch, so there the two agree up to rounding.

`loss_chunks = 1`: the model returns logits [B, T, V] and the loss reads them.

`loss_chunks = n > 1` (chunked output head): the model returns its final hidden states [B, T, D]
(after the final norm; `Transformer.set_hidden_output`) and the loss applies the output head itself,
to at most n sequence chunks of ceil(T / n) positions, one at a time: chunk -> head -> fp32
logits -> summed cross-entropy / the step's count -> autograd.grad into the chunk's
slice of the hidden-state gradient and into the head's parameter gradients (summed over chunks
in the parameter's dtype; a plain bias-free nn.Linear head gets two matmuls per chunk and an
in-place weight-gradient sum instead of autograd). Only one chunk's logits exist at a time.
The chunk loop runs inside one autograd.Function whose inputs are the hidden states and the
head's parameters: its forward runs the loop and keeps the two gradients, its backward hands
them out times the incoming gradient. Hence:
- loss and gradients equal the unchunked ones up to fp32 summation order;
- a loss scale applies in the backward as for any loss, and the gradients reach the model in
  the ordinary backward pass;
- FSDP2: the head's gradient arrives once per micro-batch, in the unsharded parameter FSDP
  gathered for the forward, and is reduce-scattered once with its unit (no chunk backward runs
  FSDP's hooks); tied embeddings get the head's and the embedding's contributions summed;
- tensor parallel: sequence-sharded hidden states are all-gathered once (as the unchunked head
  does); under loss parallel each chunk's logits stay sharded over the vocabulary;
- forward-only (evaluation, or nothing to train in the head's path): chunks without gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

IGNORE_INDEX = -100


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the token losses over the target labels, in fp32; `logits` [B, T, V] may be
    vocabulary-sharded (TP loss parallel: call it, and the backward, under
    `LanguageModelLoss.context()`)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The target tokens of `labels` (label != -100): an int64 scalar on their device."""
    return (labels != IGNORE_INDEX).sum()


@dataclass(frozen=True)
class TargetTokens:
    """One optimizer step's count of target tokens: the divisor of its loss (module docstring).

    Built once per step by `count`, before the first backward; every micro-batch's loss divides
    its token sum by `divisor`, and the logged loss is the sum of those shares over the ranks
    that counted."""

    local: torch.Tensor
    """This rank's targets over the step's micro-batches (under CP: its pieces), int64."""
    total: torch.Tensor
    """Every counting rank's (dp x cp), int64: the step's target tokens (logged)."""
    divisor: torch.Tensor
    """`total` as float32, at least 1: a step without targets has loss 0 and no gradient."""

    @classmethod
    def count(cls, labels: Iterable[torch.Tensor], group: dist.ProcessGroup | None) -> TargetTokens:
        """This rank's count over `labels` (the step's micro-batches as this rank holds them),
        all-reduced once over `group`: the ranks that hold other tokens of the step (dp x cp;
        None or one rank: no collective). One int64 scalar all-reduce, no host sync."""
        local = torch.stack([target_tokens(x) for x in labels]).sum()
        total = local.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return cls(local, total, total.clamp(min=1).float())


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor (a loss-parallel loss is a replicated DTensor)."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class LanguageModelLoss:
    """`loss(model_output, labels, divisor)` -> the micro-batch's token-loss sum / `divisor`
    (TargetTokens.divisor of the step; see the module doc).

    `head_owner` is the module whose `output` head the chunked path applies (None on pipeline
    ranks without the last stage, or when `chunks` = 1). `sharded_logits`: TP keeps the logits
    sharded over the vocabulary, so the loss and its backward run under loss_parallel()."""

    def __init__(self, chunks: int, head_owner: nn.Module | None, sharded_logits: bool) -> None:
        if chunks < 1:
            raise ValueError(f"loss chunks must be >= 1, got {chunks}")
        self.chunks = chunks
        self.head_owner = head_owner if chunks > 1 else None
        self.sharded_logits = sharded_logits

    def context(self) -> contextlib.AbstractContextManager:
        """loss_parallel() when TP keeps the logits vocabulary-sharded, else nothing. Enter it
        once around every forward + loss + backward (the recipe wraps its training loop)."""
        return loss_parallel() if self.sharded_logits else contextlib.nullcontext()

    def __call__(
        self, output: torch.Tensor, labels: torch.Tensor, divisor: torch.Tensor | float
    ) -> torch.Tensor:
        if self.head_owner is None:
            return summed_cross_entropy(output, labels) / divisor
        owner = self.head_owner
        if isinstance(owner, FSDPModule):
            # Under reshard "always" the root resharded after its forward: gather it again (a
            # no-op when it is unsharded). Its backward reduce-scatters the head's gradient.
            owner.unshard()
        head = owner.output
        params = [p for p in head.parameters() if p.requires_grad]
        if torch.is_grad_enabled() and (output.requires_grad or params):
            return _ChunkedHeadLoss.apply(self, head, labels, divisor, output, *params)
        loss, _ = self.chunk_loop(head, output, labels, divisor, [], need_grad=False)
        return loss

    def chunk_loop(
        self,
        head: nn.Module,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        divisor: torch.Tensor | float,
        params: list[torch.Tensor],
        need_grad: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Loss of the micro-batch (its token sum / `divisor`) and (need_grad) the gradients of
        [hidden, *params]."""
        h = hidden.detach()
        if isinstance(h, DTensor) and not all(p.is_replicate() for p in h.placements):
            h = h.redistribute(h.device_mesh, [Replicate()] * h.device_mesh.ndim)
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
                loss = summed_cross_entropy(logits, labels_c) / divisor
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
            loss = summed_cross_entropy(head(chunk), labels_c) / divisor
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
    def forward(ctx, loss_fn: LanguageModelLoss, head, labels, divisor, hidden, *params):  # type: ignore[override]
        with torch.enable_grad():
            loss, grads = loss_fn.chunk_loop(
                head, hidden, labels, divisor, list(params), need_grad=True
            )
        ctx.grads = grads
        ctx.dtypes = [x.dtype for x in (hidden, *params)]
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        if isinstance(grad_loss, DTensor):
            grad_loss = grad_loss.full_tensor()
        grads = [_scaled(g, grad_loss, d) for g, d in zip(ctx.grads, ctx.dtypes, strict=True)]
        return None, None, None, None, *grads


def build_loss(
    chunks: int, model_parts: list[nn.Module], sharded_logits: bool
) -> LanguageModelLoss:
    """The loss for this rank's model parts. With chunks > 1 the part holding the output head
    (the last pipeline stage) returns hidden states and the loss applies its head."""
    owner = next((p for p in model_parts if getattr(p, "output", None) is not None), None)
    if chunks > 1 and owner is not None:
        owner.set_hidden_output(True)
    return LanguageModelLoss(chunks, owner, sharded_logits)
