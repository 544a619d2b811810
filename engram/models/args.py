"""Model shapes: `ModelArgs` and the registry `MODEL_FLAVORS[name][flavor]`.

Big flavors copy the published Hugging Face configs of the base models, so their checkpoints
load through engram/hf/adapter.py. Debug flavors take the vocabulary size from the
tokenizer (vocab_size None here). Any other checkpoint: model.flavor = "hf" reads the shape from
its config.json (engram/models/hf_config.py), no flavor needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engram.config.model import ATTN_BACKENDS, ATTN_MASK_TYPES


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (HF rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int | None = None
    """None: take it from the tokenizer (debug flavors)."""
    head_dim: int | None = None
    """None: dim // n_heads. Qwen3 sets 128 independently of dim."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    """Biases on q/k/v projections (Qwen2 / Qwen2.5)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    """Length of the precomputed RoPE table; longer inputs are an error."""
    attn_mask_type: str = "causal"
    """causal | block_causal: how attention treats packed documents (model.attn_mask_type)."""
    attn_backend: str = "sdpa"
    """sdpa | flex: the kernel of the block-causal mask (model.attn_backend)."""

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"dim {self.dim} is not divisible by n_heads {self.n_heads}: set head_dim"
                )
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name, valid in (
            ("attn_mask_type", ATTN_MASK_TYPES),
            ("attn_backend", ATTN_BACKENDS),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"ModelArgs.{name} must be one of {', '.join(valid)}, got {getattr(self, name)!r}"
                )
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArgs.{name} must be > 0, got {getattr(self, name)}")

    def replace(self, **changes: object) -> ModelArgs:
        return dataclasses.replace(self, **changes)


_LLAMA31_ROPE = RopeScaling(8.0, 1.0, 4.0, 8192)

MODEL_FLAVORS: dict[str, dict[str, ModelArgs]] = {
    "llama3": {
        "debug": ModelArgs(
            dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768, rope_theta=500000.0,
            max_seq_len=2048,
        ),
        # Benchmark size between debug and real models.
        "mid": ModelArgs(
            dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, rope_theta=500000.0,
            max_seq_len=2048,
        ),
        # Llama-3.1-8B.
        "8B": ModelArgs(
            dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
            norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, max_seq_len=8192,
        ),
    },
    "qwen2": {
        "debug": ModelArgs(
            dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768, norm_eps=1e-6,
            rope_theta=1e6, qkv_bias=True, max_seq_len=2048,
        ),
        # Qwen2.5-7B.
        "7B": ModelArgs(
            dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064,
            norm_eps=1e-6, rope_theta=1e6, qkv_bias=True, max_seq_len=8192,
        ),
        # Qwen2.5-32B (base model config: rms_norm_eps 1e-5; the Instruct config says 1e-6).
        "32B": ModelArgs(
            dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_dim=27648, vocab_size=152064,
            norm_eps=1e-5, rope_theta=1e6, qkv_bias=True, max_seq_len=8192,
        ),
    },
    "qwen3": {
        "debug": ModelArgs(
            dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768, head_dim=64,
            norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=2048,
        ),
        # Tied embeddings, as Qwen3-0.6B to 4B: one matrix is the embedding and the output head.
        "debug_tied": ModelArgs(
            dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768, head_dim=64,
            norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tie_embeddings=True, max_seq_len=2048,
        ),
        # Qwen3-8B.
        "8B": ModelArgs(
            dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, head_dim=128,
            vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=8192,
        ),
        # Qwen3-32B.
        "32B": ModelArgs(
            dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600, head_dim=128,
            vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=8192,
        ),
    },
}  # fmt: skip


def get_model_args(name: str, flavor: str) -> ModelArgs:
    """A copy of the registered shape; errors list the valid names/flavors."""
    if name not in MODEL_FLAVORS:
        raise ValueError(f"unknown model.name {name!r}; valid: {', '.join(MODEL_FLAVORS)}")
    flavors = MODEL_FLAVORS[name]
    if flavor not in flavors:
        raise ValueError(
            f"unknown model.flavor {flavor!r} for {name}; valid: {', '.join(flavors)} "
            "(or flavor 'hf': the shape of model.hf_checkpoint's config.json)"
        )
    return dataclasses.replace(flavors[flavor])
