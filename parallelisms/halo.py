"""The Engram ShortConv over a sequence split across ranks: each piece of the sequence gets the
`(kernel_size - 1) x dilation` normed positions before it from the rank that holds them.

One implementation for every split (TP's sequence shards, context parallelism's contiguous and
load-balanced chunks, and both together): the sequence is cut into equal pieces with global
indices; each rank of the halo group holds `k` of them, concatenated in its local order
(`sequence_pieces`). Every rank all-gathers the tails of all pieces; each piece takes the tail of
the piece before it (global index - 1), zeros for the first one. The all-gather's backward
reduce-scatters the halo gradients back to their owners, so the result and its gradients equal
the unsharded conv's exactly.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from engram.models.engram import ShortConv, document_conv
from parallelisms.parallel_dims import cp_chunks

# torch >= 2.10 renamed it; the old name still works there with a deprecation warning.
all_gather_autograd = getattr(
    funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd
)


def sequence_pieces(cp: int, tp: int, load_balanced: bool) -> list[list[int]]:
    """Global piece indices each rank of the flattened (cp, tp) group holds, in local order.

    The sequence is cut into the cp ranks' chunks (parallel_dims.cp_chunks: cp contiguous ones,
    or 2 x cp load-balanced ones). A cp rank's chunk(s) are then split over its tp ranks contiguously (TP's Shard(1)):
    tp rank t takes the t-th k-th of the cp rank's local sequence."""
    layout = []
    for c in range(cp):
        chunks = cp_chunks(c, cp, load_balanced)
        k = len(chunks)
        local = [chunk * tp + j for chunk in chunks for j in range(tp)]
        layout += [local[t * k : (t + 1) * k] for t in range(tp)]
    return layout


class HaloShortConv(nn.Module):
    """Mixin put in front of a ShortConv's class (by tensor_parallel.apply_tp and
    context_parallel.apply_context_parallel): the causal conv over this rank's pieces of the
    sequence, each with its halo from the rank holding the piece before it."""

    _halo_mesh: DeviceMesh
    """The 1-D group whose ranks hold the pieces (tp, or the flattened cp_tp)."""
    _halo_pieces: list[list[int]]
    """sequence_pieces(...) for that group: global piece indices per rank, in local order."""

    def forward(self, x: torch.Tensor, cache=None, doc_positions=None) -> torch.Tensor:
        """`doc_positions` [B, t]: this rank's tokens' positions in their packed documents; a
        halo tap reaching into an earlier document is dropped (document_conv), so no boundary
        needs exchanging: the halo positions precede the piece in the global sequence."""
        assert isinstance(self, ShortConv) and cache is None  # no decode cache when split
        b, t, g, d = x.shape
        reach = (self.kernel_size - 1) * self.dilation
        normed = torch.cat([self.norms[i](x[:, :, i, :]) for i in range(g)], dim=-1)  # [B, t, C]
        pieces = self._halo_pieces
        k = len(pieces[0]) if reach else 1  # a pointwise conv needs no pieces
        n = t // k  # positions per piece
        if reach:
            if n < reach:
                raise ValueError(
                    f"a sequence piece of {n} tokens per rank is shorter than the ShortConv "
                    f"reach {reach}: use a longer seq_len or a smaller tp / cp"
                )
            mesh = self._halo_mesh
            mine = pieces[mesh.get_local_rank()]
            # Every piece's tail, [k x B, reach, C] per rank, gathered over the group.
            tails = torch.cat([normed[:, (j + 1) * n - reach : (j + 1) * n] for j in range(k)])
            tails = all_gather_autograd(tails.contiguous(), gather_dim=0, group=mesh)
            where = {
                p: (r * k + j) * b for r, held in enumerate(pieces) for j, p in enumerate(held)
            }
            parts = []
            for j, p in enumerate(mine):
                # The first piece multiplies a tail by 0 instead of taking zeros, so that every
                # rank has the same autograd graph (the all-gather's backward is a collective).
                prev = tails[where[(p - 1) % len(where)] :][:b] * float(p > 0)
                parts.append(torch.cat([prev, normed[:, j * n : (j + 1) * n]], dim=1))
            normed = torch.cat(parts)  # [k x B, reach + n, C]
        if doc_positions is not None:  # pieces along the batch, as `normed`
            pos = torch.cat(doc_positions.split(n, dim=1)) if k > 1 else doc_positions
            y = document_conv(normed.transpose(1, 2), self.conv.weight, self.dilation, pos)
        else:
            # Symmetric padding, then outputs [reach, reach + n) are the causal outputs of a
            # piece.
            y = self.conv(normed.transpose(1, 2))[..., reach : reach + n]
        y = torch.cat(y.split(b), dim=-1) if k > 1 else y  # pieces back along the sequence
        return F.silu(y).transpose(1, 2).reshape(b, t, g, d)


_SWAPPED: dict[tuple[type, type], type] = {}


def swap_class(module: nn.Module, mixin: type) -> None:
    """Put `mixin` in front of `module`'s class (once per pair of classes)."""
    key = (mixin, type(module))
    if key not in _SWAPPED:
        _SWAPPED[key] = type(f"{mixin.__name__}{type(module).__name__}", key, {})
    module.__class__ = _SWAPPED[key]


def split_short_conv(conv: ShortConv, mesh: DeviceMesh, pieces: list[list[int]]) -> None:
    """Make `conv` a HaloShortConv over `mesh` with this piece layout (again: re-targets it)."""
    if not isinstance(conv, HaloShortConv):
        swap_class(conv, HaloShortConv)
    conv._halo_mesh = mesh
    conv._halo_pieces = pieces
