"""The hashing constants of an exported config.json's `engram`: derived, never trusted.

Multipliers and primes are functions of (seed, layer ids, max_ngram, heads, vocab_size_per_ngram,
compressed vocabulary): engram/hashing/ngram.py computes them. config.json stores them for
reading, but a reader must not use edited values (a changed multiplier hashes to other rows and
gives wrong logits silently), nor ignore an edited seed. `check_hash_params` derives them again
and names every stored key that disagrees; the remote modeling file does the same with its own
torch-free transcription (tests/test_hf_export_integrity.py checks the two are equal).
"""

from __future__ import annotations

from typing import Any

from engram.hashing.ngram import find_table_primes, layer_multipliers

# Keys the derivation reads; an export without them predates the check.
DERIVED_FROM = (
    "seed", "layer_ids", "max_ngram", "n_head_per_ngram", "vocab_size_per_ngram",
    "compressed_vocab",
)  # fmt: skip


class HashParamsError(ValueError):
    """config.json's `engram` hashing values disagree with what its seed and sizes derive."""


def derive_hash_params(engram: dict[str, Any]) -> dict[str, dict[str, list[int] | int]]:
    """{"multipliers", "table_primes", "table_rows"}, each keyed by str(layer id), from the
    settings in `engram` (config.json's section)."""
    absent = [k for k in DERIVED_FROM if k not in engram]
    if absent:
        raise HashParamsError(
            f"config.json's engram section lacks {absent}: the folder was exported before the "
            "hashing values were derived on load; re-export it with scripts/export_hf.py"
        )
    layers = [int(i) for i in engram["layer_ids"]]
    max_ngram, vocab = int(engram["max_ngram"]), int(engram["compressed_vocab"])
    primes = find_table_primes(
        [int(v) for v in engram["vocab_size_per_ngram"]], layers, max_ngram,
        int(engram["n_head_per_ngram"]),
    )  # fmt: skip
    seed = int(engram["seed"])
    return {
        "multipliers": {
            str(i): [int(m) for m in layer_multipliers(seed, i, max_ngram, vocab)] for i in layers
        },
        "table_primes": {str(i): primes[i] for i in layers},
        "table_rows": {str(i): sum(primes[i]) for i in layers},
    }


def check_hash_params(engram: dict[str, Any], source: str) -> dict[str, Any]:
    """The derived values (derive_hash_params) when every stored one equals them; else
    HashParamsError naming each differing `engram.<key>[layer]` of `source`."""
    derived = derive_hash_params(engram)
    diffs = []
    for key, per_layer in derived.items():
        stored = engram.get(key)
        if not isinstance(stored, dict):
            diffs.append(f"engram.{key} is missing or not a table keyed by layer id")
            continue
        for layer, want in per_layer.items():
            got = stored.get(layer)
            if got != want:
                diffs.append(f"engram.{key}[{layer!r}] = {got}, but the settings derive {want}")
        diffs += [f"engram.{key}[{k!r}]: not an Engram layer" for k in stored if k not in per_layer]
    if diffs:
        raise HashParamsError(
            f"{source}: the stored hashing values disagree with engram.seed = {engram['seed']} "
            "and the table sizes that derive them:\n  "
            + "\n  ".join(diffs)
            + "\nThe file was edited (a changed multiplier or prime hashes to other rows; the seed "
            "alone changes nothing): restore it from the export, or re-export with the settings "
            "you want"
        )
    return derived
