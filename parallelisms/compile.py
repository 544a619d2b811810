"""torch.compile per decoder block, with the Engram table lookup kept eager.

Each `TransformerBlock.forward` is compiled in place (`block.forward = torch.compile(...)`), so
module names, state dicts and checkpoints carry no `_orig_mod.` prefix, and the hooks that
activation checkpointing and FSDP2 put around the block run eagerly outside the compiled code
(FSDP's all-gathers and reduce-scatters stay ordinary collectives). Blocks of the same shape
share one compiled graph (dynamo inlines nn modules and treats their parameters as inputs).

The Engram table lookup (parallelisms/engram_tables/) is excluded with `torch.compiler.disable`:
it reads the id counts on the host (`int(...)`) to size its all-to-alls, which no graph can hold.
Dynamo breaks the Engram block's graph there: hash-id slicing before, the dense Engram part (key /
value projections, norms, gate, ShortConv), attention and FFN after, are compiled; the lookup and
its backward (an autograd.Function) run eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

from engram.config import Compile as CompileConfig
from engram.models.transformer import unwrap_block

__all__ = ["apply_compile", "decoder_blocks"]


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The TransformerBlocks inside any activation-checkpoint wrappers, in layer order."""
    return [unwrap_block(layer) for layer in model.layers.values()]


def apply_compile(model: nn.Module, cfg: CompileConfig) -> None:
    """Compile every decoder block's forward; the Engram table lookups stay eager."""
    if not cfg.enable:
        return
    for block in model.engram_blocks().values():
        block.table.forward = torch.compiler.disable(block.table.forward)
    for block in decoder_blocks(model):
        block.forward = torch.compile(block.forward, backend=cfg.backend)
