"""Dense decoder family (Llama-3 / Qwen2 / Qwen2.5 / Qwen3 shapes) carrying Engram blocks."""

from engram.models.args import MODEL_FLAVORS, ModelArgs, RopeScaling, get_model_args
from engram.models.builder import build_model, model_args_for
from engram.models.transformer import Transformer

__all__ = [
    "MODEL_FLAVORS",
    "ModelArgs",
    "RopeScaling",
    "Transformer",
    "build_model",
    "get_model_args",
    "model_args_for",
]
