"""Dense decoder (Llama-3 / Qwen2 / Qwen2.5 / Qwen3 shapes) with Engram blocks at chosen layers.

Module names follow torchtitan (tok_embeddings, layers["i"], attention.wq/wk/wv/wo,
feed_forward.w1/w2/w3, attention_norm, ffn_norm, norm, output) so per-layer FSDP, TP plans and
pipeline splits address modules by name. RoPE uses the rotate-half convention of Hugging Face, so
HF checkpoints load without permuting q/k rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engram.config import Engram as EngramConfig
from engram.models.args import ModelArgs, RopeScaling
from engram.models.decode_cache import DecodeCache, LayerCache
from engram.models.documents import BlockMask, document_mask, document_starts, flex_kernel
from engram.models.engram import EngramBlock, RMSNorm
from engram.models.init import init_constant_, init_normal_
from engram.models.lora import LoRAMixin

# Prefixes that wrappers insert into parameter names; stripped so init keys (and hence the
# weights) do not depend on activation checkpointing or torch.compile.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_fqn(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with HF's "llama3" scaling when given."""
    # float32 throughout, as HF computes it, for logit parity with HF checkpoints.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """[2, max_seq_len, head_dim] float32: cos and sin, each frequency repeated for both halves."""
    assert args.head_dim is not None
    inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)
    pos = torch.arange(args.max_seq_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([emb.cos(), emb.sin()]).to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, Dh]; cos/sin: [T, Dh], or [B, T, Dh] (per-document positions). Computed in
    float32."""
    xf = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


# A dense bool mask [B, 1, Tq, Tk] (SDPA) or FlexAttention's BlockMask.
AttentionMask = torch.Tensor | BlockMask


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.head_dim is not None
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        self.backend = args.attn_backend
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """`cache`: keys / values of earlier positions (incremental decoding), extended here.
        `mask`: the documents' mask from `document_mask` (packed documents kept apart)."""
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, H, T, Dh]
        if cache is None:
            out = self.attend(q, k, v, mask)
        else:
            past = 0 if cache.keys is None else cache.keys.shape[2]
            k, v = cache.append_kv(k, v)
            # query i sees keys 0 .. past + i
            keep = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(past)
            out = self.kernel(q, k, v, attn_mask=None if past == 0 else keep)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """Causal attention of q [B, Hq, T, Dh] over k, v [B, Hkv, T, Dh] of the same positions
        (with `mask`: its documents' mask). Context parallelism
        (parallelisms/context_parallel.py) overrides it to exchange heads or gather K / V around
        `kernel`."""
        return self.kernel(q, k, v, attn_mask=mask)

    def document_mask(self, starts: torch.Tensor, positions: torch.Tensor) -> AttentionMask:
        """The mask `attend` needs to keep packed documents apart, built once per forward and
        shared by every layer: `starts` [B, T] (engram/models/documents.py document_starts) of
        the whole sequence, `positions` [t] the global positions this part's tokens hold. Here
        the kernel sees the whole sequence (queries = keys = 0 .. T - 1); context parallelism
        overrides it where it does not."""
        whole = torch.arange(starts.shape[1], device=starts.device)
        return document_mask(whole, starts, whole, self.backend)

    def kernel(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """The attention kernel: SDPA, causal without a mask, else `attn_mask` (True: attend);
        FlexAttention with a BlockMask (model.attn_backend = "flex")."""
        if self.n_rep > 1:
            # repeat_kv instead of enable_gqa: every backend (incl. torch_npu) supports it.
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        if attn_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if isinstance(attn_mask, BlockMask):
            return flex_kernel(q, k, v, attn_mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(
        self, layer_id: int, args: ModelArgs, engram: EngramConfig | None, table_rows: int | None
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.engram: EngramBlock | None = None
        if engram is not None:
            assert table_rows is not None
            self.engram = EngramBlock(args.dim, engram, table_rows, layer_id)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        hash_ids: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        mask: AttentionMask | None = None,
        doc_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`mask` and `doc_positions` [B, T] (each token's position in its document): packed
        documents kept apart (Transformer.forward with segment_ids)."""
        if self.engram is not None:
            if hash_ids is None:
                raise ValueError(f"layer {self.layer_id} has an Engram block but got no hash_ids")
            h = h + self.engram(h, hash_ids, cache, doc_positions)
        h = h + self.attention(self.attention_norm(h), cos, sin, cache, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        engram_cfg: EngramConfig | None = None,
        table_rows: dict[int, int] | None = None,
    ) -> None:
        super().__init__()
        if args.vocab_size is None:
            raise ValueError("ModelArgs.vocab_size is None: resolve it with model_args_for()")
        self.args = args
        self.engram_cfg = engram_cfg
        self.engram_layer_order: list[int] = list(engram_cfg.layer_ids) if engram_cfg else []
        self._engram_slot = {lid: i for i, lid in enumerate(self.engram_layer_order)}
        table_rows = table_rows or {}
        for lid in self.engram_layer_order:
            if lid not in table_rows:
                raise ValueError(f"table_rows has no entry for Engram layer {lid}")

        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict()
        for i in range(args.n_layers):
            has = i in self._engram_slot
            self.layers[str(i)] = TransformerBlock(
                i, args, engram_cfg if has else None, table_rows.get(i) if has else None
            )
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        if args.tie_embeddings:  # one matrix, one state-dict entry (checkpoints store it once)
            self._register_state_dict_hook(_drop_tied_output)
            self.register_load_state_dict_post_hook(_tied_output_not_missing)
        # Non-persistent: recomputed in init_weights() (meta-built models have no values).
        self.register_buffer("rope_cache", rope_cos_sin(args), persistent=False)
        # Two settings of how forward reads its input and what it returns, stated here and
        # changed after construction only through their setters below (each has one caller).
        self.input_seq_shards: int = 1
        """Pieces of the sequence this part's input is split into (each rank gets T / n
        positions; forward multiplies back to the full T for RoPE and the hash ids): 1, except
        on a later pipeline stage under TP sequence parallel, whose input hidden states arrive
        sharded along the sequence. Set by `set_input_seq_shards`, called by
        parallelisms/parallelize.py (parallelize_model, right after apply_tp)."""
        self.return_hidden: bool = False
        """Forward returns the final hidden states (after the norm) instead of logits, because
        the loss applies the output head itself (chunked loss). Set by `set_hidden_output`,
        called by engram/train/loss.py (build_loss, on the part holding the head)."""

    # ------------------------------------------------------------------ run-time settings

    def set_input_seq_shards(self, shards: int) -> None:
        """This part's input arrives as 1 / `shards` of the sequence (see input_seq_shards)."""
        self.input_seq_shards = shards

    def set_hidden_output(self, enabled: bool) -> None:
        """Forward returns hidden states instead of logits when `enabled` (see return_hidden)."""
        self.return_hidden = enabled

    # ------------------------------------------------------------------ tied embeddings

    def tie_weights(self) -> None:
        """With args.tie_embeddings, make output.weight the very Parameter tok_embeddings.weight.

        Called at construction and again after every conversion (`_apply`: to_empty, to, float),
        because nn.Module._apply builds a new Parameter per module and so unties them. Under
        FSDP2 both modules must be in one fully_shard unit (the root); FSDP2 then gathers the
        shared parameter once and sets it on both modules."""
        if not self.args.tie_embeddings:
            return
        if self.tok_embeddings is None or self.output is None:
            raise ValueError(
                "tie_embeddings needs the embedding and the output head in the same module (one "
                "pipeline stage): untie the model (a flavor with tie_embeddings=False)"
            )
        emb = self.tok_embeddings.weight
        for part in (self.tok_embeddings, self.output):
            if isinstance(part, FSDPModule):
                raise ValueError(
                    f"tie_embeddings: {type(part).__name__} is wrapped by its own fully_shard, so "
                    "FSDP would shard the tied matrix twice: shard tok_embeddings and output "
                    "with the root module (parallelisms/fsdp.py does)"
                )
        out = self.output.weight
        if isinstance(emb, DTensor) != isinstance(out, DTensor) or (
            isinstance(emb, DTensor)
            and (emb.placements != out.placements or emb.device_mesh != out.device_mesh)
        ):
            raise ValueError(
                "tie_embeddings: tok_embeddings.weight and output.weight are sharded differently "
                f"({_placements(emb)} vs {_placements(out)}), so one tensor cannot serve both "
                "(tensor parallelism shards them on different dims): untie the model or drop tp"
            )
        self.output.weight = emb

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        hash_ids: torch.Tensor | None = None,
        cache: DecodeCache | None = None,
        last_positions: int | None = None,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] (or hidden states [B, T, D] on a later pipeline stage);
        hash_ids (keyword-only: a pipeline schedule forwards keyword arguments to every stage)
        [B, T, L, H] with L = len(engram_layer_order) -> logits [B, T, V] (or hidden
        states [B, T, D] when this stage has no output head, or `return_hidden` is set). With
        `cache` (an unsharded model only) the input continues the cached positions, and the
        cache is extended by it. `last_positions`: logits of only the last positions [B, n, V]
        (generation samples from the last one; unsharded models only). `positions` [B, T]: the
        global position of every input token (context parallelism hands each rank chunks of
        the sequence; RoPE needs where they are); default 0 .. T - 1 (after the cache).
        `segment_ids` [B, T_whole]: the document of every token of the whole sequence (also
        under context parallelism, where `positions` say which of them this rank holds); read
        only when args.attn_mask_type = "block_causal" (engram/models/documents.py): attention
        and the Engram ShortConv stay within documents, RoPE positions restart per document."""
        b, t = input_ids.shape[0], input_ids.shape[1] * self.input_seq_shards
        start = 0 if cache is None else cache.pos
        if start + t > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {start + t} exceeds max_seq_len {self.args.max_seq_len} of the "
                "RoPE table; build the model with a larger max_seq_len"
            )
        self._check_hash_ids(hash_ids, b, t)
        h = self.tok_embeddings(input_ids) if self.tok_embeddings is not None else input_ids
        mask = doc_positions = None
        if segment_ids is not None and self.args.attn_mask_type == "block_causal":
            if cache is not None:
                raise ValueError("incremental decoding runs one document: pass no segment_ids")
            pos = torch.arange(t, device=h.device) if positions is None else positions[0]
            mask, doc_positions = self._documents(segment_ids, pos, b)
            # RoPE restarts per document (as generation starts each one at 0); RoPE is
            # relative, so within a document global positions give the same up to rounding.
            cos, sin = self.rope_cache[0, doc_positions], self.rope_cache[1, doc_positions]
        elif positions is None:
            cos, sin = self.rope_cache[0, start : start + t], self.rope_cache[1, start : start + t]
        else:  # every row of a batch holds the same positions
            cos, sin = self.rope_cache[0, positions[0]], self.rope_cache[1, positions[0]]
        for layer in self.layers.values():
            layer_id = unwrap_block(layer).layer_id
            slot = self._engram_slot.get(layer_id)
            ids = hash_ids[:, :, slot] if slot is not None and hash_ids is not None else None
            layer_cache = None if cache is None else cache.layer(layer_id)
            h = layer(h, cos, sin, ids, layer_cache, mask=mask, doc_positions=doc_positions)
        if cache is not None:
            cache.pos += t
        if last_positions is not None:
            h = h[:, -last_positions:]
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None and not self.return_hidden else h

    def _documents(
        self, segment_ids: torch.Tensor, pos: torch.Tensor, b: int
    ) -> tuple[AttentionMask | None, torch.Tensor]:
        """(the attention's mask, each token's position in its document [B, t]) for the tokens
        at global positions `pos` [t] of the whole sequence's `segment_ids` [B, T]."""
        if segment_ids.dim() != 2 or segment_ids.shape[0] != b or segment_ids.shape[1] < len(pos):
            raise ValueError(
                f"segment_ids shape {tuple(segment_ids.shape)} does not cover the batch's {b} "
                f"sequences of (at least) {len(pos)} positions: pass [B, T] segment ids of the "
                "whole sequence (not cut for context parallelism)"
            )
        starts = document_starts(segment_ids)
        doc_positions = pos - starts[:, pos]
        blocks = [unwrap_block(layer) for layer in self.layers.values()]
        mask = blocks[0].attention.document_mask(starts, pos) if blocks else None
        return mask, doc_positions

    def _check_hash_ids(self, hash_ids: torch.Tensor | None, b: int, t: int) -> None:
        if not self.engram_layer_order:
            return
        assert self.engram_cfg is not None
        expected = (b, t, len(self.engram_layer_order), self.engram_cfg.num_heads)
        if hash_ids is None:
            raise ValueError(
                f"this model has Engram layers {self.engram_layer_order}: pass hash_ids of shape "
                f"[B, T, L, H] = {expected} (from the data loader's NgramHasher)"
            )
        if tuple(hash_ids.shape) != expected:
            raise ValueError(
                f"hash_ids shape {tuple(hash_ids.shape)} != expected [B, T, L, H] = {expected} "
                f"(L = Engram layers {self.engram_layer_order}, H = hash heads per layer)"
            )

    # ------------------------------------------------------------------ init

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE table (needed after to_empty() of a meta-built model)."""
        if device is None:
            device = self.rope_cache.device
        self.rope_cache = rope_cos_sin(self.args, torch.device(device))

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | str | None = None) -> None:
        """Deterministic init of every parameter (same weights at every parallel layout and
        wrapping), then the buffers. Linears std 0.02; wo / w2 depth-scaled; norms 1; biases 0;
        Engram blocks per engram_cfg.init."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.args.n_layers)
        done: set[int] = set()
        for name, module in self.named_modules():
            if isinstance(module, EngramBlock):
                module.init_weights(seed, clean_fqn(name), std)
                done.update(id(p) for p in module.parameters())
            elif isinstance(module, LoRAMixin):  # the base weight takes the rules below
                module.init_lora(seed, clean_fqn(name))
                done.update((id(module.lora_A), id(module.lora_B)))
        for raw_name, param in self.named_parameters():
            if id(param) in done:
                continue
            name = clean_fqn(raw_name)
            leaf = name.rsplit(".", 2)
            if name.endswith(".bias"):
                init_constant_(param, 0.0)
            elif "norm" in leaf[-2]:
                init_constant_(param, 1.0)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                init_normal_(param, out_std, seed, name)
            elif name.endswith(".weight") and leaf[-2] in (
                "wq", "wk", "wv", "w1", "w3", "tok_embeddings", "output"
            ):  # fmt: skip
                init_normal_(param, std, seed, name)
            else:
                raise RuntimeError(f"init_weights has no rule for parameter {name}")
            done.add(id(param))
        self.init_buffers(buffer_device)

    def engram_blocks(self) -> dict[int, EngramBlock]:
        """Engram blocks present in this module (a pipeline stage may hold only some)."""
        blocks = {}
        for layer in self.layers.values():
            inner = unwrap_block(layer)
            if inner.engram is not None:
                blocks[inner.layer_id] = inner.engram
        return blocks


def _drop_tied_output(module: nn.Module, state_dict: dict, prefix: str, _meta) -> None:
    state_dict.pop(prefix + "output.weight", None)


def _tied_output_not_missing(module: nn.Module, incompatible) -> None:
    # output.weight is tok_embeddings.weight, which the state dict fills.
    for key in [k for k in incompatible.missing_keys if k.split(".")[-2:] == ["output", "weight"]]:
        incompatible.missing_keys.remove(key)


def _placements(t: torch.Tensor) -> str:
    return str(tuple(t.placements)) if isinstance(t, DTensor) else "a plain tensor"


def unwrap_block(layer: nn.Module) -> TransformerBlock:
    """The TransformerBlock inside activation-checkpoint / compile wrappers."""
    while not isinstance(layer, TransformerBlock):
        inner = getattr(layer, "_checkpoint_wrapped_module", None) or getattr(
            layer, "_orig_mod", None
        )
        if inner is None:
            raise TypeError(f"unexpected module in Transformer.layers: {type(layer).__name__}")
        layer = inner
    return layer
