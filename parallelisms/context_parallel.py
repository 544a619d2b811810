"""Context parallelism: the cp ranks of one data-parallel replica split each sample's sequence.

    split_batch              the one place a batch is cut along the sequence (ids, labels,
                             positions, hash ids), by `chunk_positions`
    apply_context_parallel   the parallelize_model step: attention sees the whole sequence,
                             the Engram ShortConv takes its halo from its neighbours

Methods (parallelism.cp_method):

- ulysses: contiguous chunks (rank c holds tokens [c T / cp, (c + 1) T / cp)). Before the kernel
  an all-to-all turns sequence-sharded q / k / v [B, H, T / cp, Dh] into head-sharded
  [B, H / cp, T, Dh]; the kernel (SDPA, or any other) runs unchanged on the whole sequence of its
  heads; a second all-to-all turns the output back. Needs query and KV heads divisible by
  tp x cp (checked by ParallelDims.check_model). Moves 4 x B x T / cp x H x Dh elements per rank
  per layer (q, k, v, out; KV heads before repeat).
- allgather_kv: load-balanced chunks (rank c holds chunks c and 2 cp - 1 - c of 2 cp, so every
  rank has the same causal work). Each rank keeps its queries, all-gathers K and V over cp, and
  attends with a mask built from the global positions of its queries and of the gathered keys.
  Any head count; the mask is [T / cp, T] per rank (a fused masked kernel is future work).

Both collectives are torch's differentiable functional ones (all_to_all_single_autograd: the
backward is the reverse all-to-all; all_gather_single_autograd: the backward reduce-scatters, so
a key's gradient sums every rank's queries). Hash ids are computed by the loader from the whole
sequence, so n-grams crossing a chunk boundary are exact; RoPE reads the global positions.

Packed documents (model.attn_mask_type = "block_causal"): segment_ids stay whole on every rank
and the model derives where each document starts once per forward (engram/models/documents.py),
so no boundary is exchanged. Ulysses' kernel sees the whole sequence and takes the
whole-sequence block-causal mask; all-gather K/V masks its queries by their global positions and
their documents' starts against the gathered keys' global positions (`document_mask` below,
[B, T / cp, T] with SDPA); the ShortConv drops halo taps that reach into an earlier document.

What else cp touches: FSDP shards over dp_shard x cp and sums the gradients (parallelisms/fsdp.py),
the tables are row-sharded over dp x cp x tp (parallelize.py), and the cp ranks count the step's
target tokens with the dp ranks: each divides its pieces' token sum by that one count
(engram/train/loss.py TargetTokens).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from engram.models.documents import document_mask
from engram.models.transformer import Attention, AttentionMask, Transformer, unwrap_block
from parallelisms.halo import all_gather_autograd, sequence_pieces, split_short_conv, swap_class
from parallelisms.parallel_dims import ParallelDims, cp_chunks

# Batch entries laid out along the sequence (dim 1); the others pass whole: the loader's
# position, and segment_ids (packed documents: a rank's queries see keys of other ranks' chunks,
# so the model reads the documents of the whole sequence, engram/models/documents.py).
SEQUENCE_KEYS = ("input_ids", "labels", "hash_ids")


def chunk_positions(rank: int, cp: int, seq_len: int, load_balanced: bool) -> torch.Tensor:
    """Global positions rank `rank` of `cp` holds, in its local order (int64 [seq_len / cp]):
    those of its cp_chunks."""
    chunks = cp_chunks(rank, cp, load_balanced)
    n = seq_len // (cp * len(chunks))
    return torch.cat([torch.arange(c * n, (c + 1) * n) for c in chunks])


def split_batch(batch: dict[str, torch.Tensor], dims: ParallelDims) -> dict[str, torch.Tensor]:
    """This cp rank's part of a batch: input_ids, labels, hash_ids (computed by the loader from the
    whole sequence) cut along the sequence (dim 1), segment_ids whole, plus `positions`
    [B, T / cp] (global, for RoPE and packed documents). At cp = 1 the whole batch (same
    path)."""
    mesh = dims.mesh("cp")
    b, t = batch["input_ids"].shape[:2]
    if t % dims.cp_chunk_count:
        raise ValueError(
            f"a batch of {t} tokens per sample cannot be cut into cp={dims.cp} "
            f"{dims.cp_method} chunks: use a seq_len that is a multiple of it (ParallelDims)"
        )
    pos = chunk_positions(mesh.get_local_rank(), dims.cp, t, dims.cp_load_balanced)
    pos = pos.to(batch["input_ids"].device)
    out = {k: v.index_select(1, pos) if k in SEQUENCE_KEYS else v for k, v in batch.items()}
    out["positions"] = pos.expand(b, -1)
    return out


# ----------------------------------------------------------------------------- attention


def _seq_to_heads(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """[B, H, T / cp, Dh] (this rank's tokens) -> [B, H / cp, T, Dh] (this rank's heads)."""
    cp = mesh.size()
    b, h, t, d = x.shape
    send = x.reshape(b, cp, h // cp, t, d).transpose(0, 1).contiguous()  # [cp, B, H/cp, t, Dh]
    got = funcol.all_to_all_single_autograd(send, None, None, mesh)  # [cp (token chunk), ...]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _heads_to_seq(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """[B, H / cp, T, Dh] (this rank's heads) -> [B, H, T / cp, Dh] (this rank's tokens)."""
    cp = mesh.size()
    b, h, t, d = x.shape
    send = x.reshape(b, h, cp, t // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    got = funcol.all_to_all_single_autograd(send, None, None, mesh)  # [cp (head group), ...]
    return got.transpose(0, 1).reshape(b, h * cp, t // cp, d)


class UlyssesAttention(nn.Module):
    """Mixin in front of Attention: heads exchanged for tokens around the unchanged kernel."""

    _cp_mesh: DeviceMesh

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        # Packed documents: the kernel sees the whole sequence, so Attention.document_mask's
        # whole-sequence mask is the one it needs.
        assert isinstance(self, Attention)
        mesh = self._cp_mesh
        q, k, v = (_seq_to_heads(z, mesh) for z in (q, k, v))
        return _heads_to_seq(self.kernel(q, k, v, attn_mask=mask), mesh)


class AllGatherKVAttention(nn.Module):
    """Mixin in front of Attention: this rank's queries over the all-gathered keys and values,
    masked by global position (load-balanced chunks)."""

    _cp_mesh: DeviceMesh
    _cp_masks: dict

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        assert isinstance(self, Attention)
        mesh = self._cp_mesh
        k = all_gather_autograd(k.contiguous(), gather_dim=2, group=mesh)
        v = all_gather_autograd(v.contiguous(), gather_dim=2, group=mesh)
        if mask is None:
            mask = self._mask(q.shape[2], q.device)
        return self.kernel(q, k, v, attn_mask=mask)

    def document_mask(self, starts: torch.Tensor, positions: torch.Tensor) -> AttentionMask:
        """Packed documents: this rank's queries (global `positions`, documents starting at
        `starts` [B, T] of the whole sequence) over the gathered keys in their gather order."""
        assert isinstance(self, Attention)
        cp, seq = self._cp_mesh.size(), starts.shape[1]
        kpos = torch.cat([chunk_positions(r, cp, seq, True) for r in range(cp)])
        kpos = kpos.to(starts.device)
        return document_mask(positions, starts[:, positions], kpos, self.backend)

    def _mask(self, t: int, device: torch.device) -> torch.Tensor:
        """[t, cp x t] bool: query i (global position qpos[i]) sees key j when kpos[j] <= qpos[i]."""
        key = (t, str(device))
        if key not in self._cp_masks:
            cp, rank = self._cp_mesh.size(), self._cp_mesh.get_local_rank()
            seq = t * cp
            qpos = chunk_positions(rank, cp, seq, True)
            kpos = torch.cat([chunk_positions(r, cp, seq, True) for r in range(cp)])
            self._cp_masks[key] = (kpos[None, :] <= qpos[:, None]).to(device)
        return self._cp_masks[key]


# ----------------------------------------------------------------------------- the step


def apply_context_parallel(model: Transformer, dims: ParallelDims) -> None:
    """Every attention exchanges heads (ulysses) or gathers K / V (allgather_kv) over the cp
    mesh; every Engram ShortConv takes its halo over the cp x tp pieces. No-op at cp = 1."""
    if not dims.cp_enabled:
        return
    cp_mesh = dims.mesh("cp")
    mixin = UlyssesAttention if dims.cp_method == "ulysses" else AllGatherKVAttention
    pieces = sequence_pieces(dims.cp, dims.tp, dims.cp_load_balanced)
    for layer in model.layers.values():
        block = unwrap_block(layer)
        swap_class(block.attention, mixin)
        block.attention._cp_mesh = cp_mesh
        block.attention._cp_masks = {}
        if block.engram is not None:
            split_short_conv(block.engram.short_conv, dims.mesh("cp_tp"), pieces)
