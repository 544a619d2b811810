"""Hugging Face interchange: our checkpoints <-> HF folders, PEFT adapters and transformers.

- `adapter.py`: our parameter names <-> HF's (Llama / Qwen2 / Qwen3 layouts).
- `load.py`: read an HF backbone folder into a (sharded) model.
- `export.py`: a run's checkpoint -> a self-contained HF folder (safetensors, config.json,
  tokenizer, the remote modeling file), and its re-import.
- `peft.py`: a LoRA run -> a PEFT adapter folder.
- `checksums.py`: the exported folder's checksums.sha256 (written by every export, verified by
  our readers).
- `hash_params.py`: config.json's Engram multipliers / primes, derived again and checked on load.
- `remote/modeling_engram.py`: the transformers modeling file shipped in exports (torch +
  transformers only, imports nothing from this repo).

A new export format goes here.
"""
