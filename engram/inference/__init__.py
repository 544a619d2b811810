"""Inference: a trained model, its weights and the decode loop, for every entry point that runs one
(recipes/generate.py, scripts/eval_perplexity.py, scripts/export_hf.py, benchmarks).

- `build.py`: the training recipe's model, unsharded on one device, for inference.
- `weights.py`: where its weights come from (a run's checkpoint, the HF folder or the init).
- `decode.py`: the token-by-token decode loop (KV cache, on-device Engram hash ids).
- `sampling.py`: the next token from the last position's logits (greedy, temperature, top-k).
- `prompt.py`: a prompt's token ids and the warning for positions past training.seq_len.
- `qa.py`: exact match of greedy answers to a chat set's questions (scripts/eval_qa.py, the
  training loop's data.eval_exact_match).
- `export_run.py`: a run's checkpoint -> an export folder (scripts/export_hf.py, and the recipes'
  export.folder at the end of a run; the formats are engram/hf/'s).

A new sampler, decoding strategy or inference source goes here; the CLI stays in the recipe.
"""

from engram.inference.build import build_for_generation
from engram.inference.decode import generate
from engram.inference.prompt import encode_prompt, warn_if_longer_than_trained
from engram.inference.sampling import sample_next
from engram.inference.weights import SOURCES, load_checkpoint_weights, load_weights

__all__ = [
    "SOURCES",
    "build_for_generation",
    "encode_prompt",
    "generate",
    "load_checkpoint_weights",
    "load_weights",
    "sample_next",
    "warn_if_longer_than_trained",
]
