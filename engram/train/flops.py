"""FLOPs per token of the model as built: the numerator of the logged `tflops` and `mfu`.

torchtitan's count (`6 N + 12 L H Q T`), extended to frozen weights and the Engram block. Per
token of a training sequence, forward plus backward:

- Weights. A weight used once per token in a product costs 2 FLOPs forward (multiply + add), 2
  for the input gradient and 2 for its own gradient: **6 N** for trained weights. A frozen weight
  (training.mode `engram_only` / `lora`) computes no weight gradient: **4 N**. A frozen weight in
  a decoder layer before the first layer that holds any trainable parameter has no backward at
  all (autograd stops there): **2 N**.
- N is every parameter of the model except the token embedding (a gather; torchtitan leaves it
  out too) and the Engram tables (a gather: 0 FLOPs; their gradient is an index-add). N includes
  the output head (a tied embedding counts once, as the head), the LoRA adapters (A and B), the
  Engram key / value projections and the ShortConv's depthwise weights (each weight is used once
  per token, like a linear's), and the norm weights and biases (as torchtitan's all-parameter N;
  their ~1 FLOP per weight is noise next to the matmuls).
- Attention: **12 L H Q T** (torchtitan): Q K^T and the weighted sum of V are 2 H Q T FLOPs each
  per token and layer forward, twice that backward. H = query heads, Q = head_dim (torchtitan
  writes dim / heads; the same number except for qwen3, whose head_dim is set on its own),
  T = training.seq_len. No halving for the causal mask (as torchtitan). A layer without backward
  counts 4 H Q T.
- Engram gate: per Engram layer and branch the dot product <key, query> over D: 2 D forward and
  4 D backward, **6 hc D** (no weights, so not in N). The sigmoid, the gate product and the
  norms are elementwise and not counted (as torchtitan counts no elementwise work).
- Recomputation by activation checkpointing is not counted: this is MFU, not hardware FLOPs.

Approximation (an overcount, never an undercount of the work done): inside the first layer that
trains, frozen weights whose input needs no gradient are still counted 4 N (lora: layer 0's
q / k / v base weights, whose input comes from the frozen embedding; engram_only: the gate's
query gradient at the first Engram layer). Count the model as built, before any parallelism
(the meta model of `build_meta_model`): names without wrapper prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from engram.config import Lora
from engram.models.engram import is_table_param
from engram.models.lora import LoRAMixin, lora_targets
from engram.optim.builder import is_trainable


@dataclass(frozen=True)
class FlopCount:
    """FLOPs per token of one training sequence position, by term (see the module docstring)."""

    seq_len: int
    trained_params: int
    """Weights counted 6 per token."""
    frozen_params: int
    """Frozen weights with an input gradient, 4 per token."""
    forward_only_params: int
    """Frozen weights in layers before the first trainable one, 2 per token."""
    attention: int
    """12 H Q T per layer (4 H Q T in a layer without backward)."""
    engram_gate: int
    """6 hc D per Engram layer."""

    @property
    def weights(self) -> int:
        return 6 * self.trained_params + 4 * self.frozen_params + 2 * self.forward_only_params

    @property
    def per_token(self) -> int:
        return self.weights + self.attention + self.engram_gate

    def describe(self) -> str:
        g = 1e9
        return (
            f"model FLOPs per token {self.per_token / g:,.3f} G = weights "
            f"{self.weights / g:,.3f} G (6 x {self.trained_params:,} trained + 4 x "
            f"{self.frozen_params:,} frozen + 2 x {self.forward_only_params:,} forward-only) "
            f"+ attention {self.attention / g:,.3f} G (T = {self.seq_len}) + Engram gate "
            f"{self.engram_gate / g:,.6f} G; recomputation not counted"
        )


def _layer_of(name: str) -> int | None:
    head, _, rest = name.partition(".")
    index = rest.partition(".")[0]
    return int(index) if head == "layers" and index.isdigit() else None


def count_flops(model: nn.Module, seq_len: int, mode: str, lora: Lora | None = None) -> FlopCount:
    """FLOPs per token of `model` (a Transformer as built, meta is fine) trained at `seq_len` in
    training.mode `mode`. In lora mode the adapters that parallelisms/lora.py will add
    (`lora.target_modules`, `lora.rank`) are counted if the model does not carry them yet."""
    args = model.args
    params: list[tuple[int | None, int, bool]] = []  # (layer, numel, trains)
    for name, p in model.named_parameters():
        if is_table_param(name):
            continue
        if name.startswith("tok_embeddings.") and not args.tie_embeddings:
            continue  # a gather; tied, the same matrix is the output head's
        params.append((_layer_of(name), p.numel(), is_trainable(name, mode)))
    if mode == "lora":
        lora = lora or Lora()
        for name, module in lora_targets(model, lora):
            if isinstance(module, LoRAMixin):
                continue
            n = lora.rank * (module.in_features + module.out_features)
            params.append((_layer_of(name), n, True))

    trains = [layer for layer, _, t in params if t and layer is not None]
    first = min(trains) if trains else args.n_layers  # layers before it have no backward
    trained = sum(n for _, n, t in params if t)
    forward_only = sum(n for layer, n, t in params if not t and layer is not None and layer < first)
    frozen = sum(n for _, n, t in params if not t) - forward_only

    hqt = args.n_heads * args.head_dim * seq_len
    attention = sum(12 * hqt if i >= first else 4 * hqt for i in range(args.n_layers))
    gate = sum(
        (6 if i >= first else 2) * block.hc_mult * block.dim
        for i, block in model.engram_blocks().items()
    )
    return FlopCount(seq_len, trained, frozen, forward_only, attention, gate)


def model_flops(model: nn.Module, cfg) -> FlopCount:
    """count_flops for a job: its seq_len, training mode and LoRA settings."""
    return count_flops(model, cfg.training.seq_len, cfg.training.mode, cfg.lora)
