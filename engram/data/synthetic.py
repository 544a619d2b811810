"""Synthetic "facts" corpus: a seeded fact base about made-up entities, rendered as documents.

Train and held-out documents state facts from the SAME fact base but are drawn from different
random streams, so held-out loss measures recall of memorised facts (what Engram should help
with) rather than generalisation to new facts. Document `i` of a split is a pure function of
(fact seed, stream seed, split, i): any document can be produced in O(1), which makes loader
resume cheap and exact. `part_entities` splits the entities into a pretrain and a finetune part
(data.synthetic_part); synthetic_chat.py asks questions about them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

_ONSETS = "b d f g h k l m n p r s t v z th sh ch kr br dr gl tr st pl qu".split()
_VOWELS = "a e i o u a e o ai ou ei ia".split()
_CODAS = ["", "", "", "n", "r", "s", "l", "k", "th", "m", "x", "nd"]

_COLOURS = (
    "red orange yellow green blue indigo violet purple crimson scarlet amber teal "
    "turquoise silver golden white black grey maroon olive"
).split()
_EXPORTS = (
    "copper tin salt wool silk timber amber coffee tea rice barley honey marble glass "
    "iron pearls spices olives wine cotton"
).split()
_ANIMALS = (
    "owl fox bear wolf eagle heron otter lynx badger falcon stag boar swan raven tiger "
    "crane hare seal bison ibex"
).split()

# attribute -> sentence templates; {e} is the entity, {v} the value.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "capital": (
        "The capital of {e} is {v}.",
        "{v} is the capital of {e}.",
        "The capital city of {e} is called {v}.",
    ),
    "colour": (
        "The flag of {e} is {v}.",
        "The national colour of {e} is {v}.",
        "{e} is known for the colour {v}.",
    ),
    "founder": (
        "{e} was founded by {v}.",
        "The founder of {e} was {v}.",
        "{v} founded {e}.",
    ),
    "year": (
        "{e} was established in {v}.",
        "In {v}, {e} was established.",
        "The founding year of {e} is {v}.",
    ),
    "export": (
        "The main export of {e} is {v}.",
        "{e} exports mostly {v}.",
        "The chief export of {e} is {v}.",
    ),
    "animal": (
        "The national animal of {e} is the {v}.",
        "{e} chose the {v} as its national animal.",
    ),
    "river": (
        "The longest river in {e} is the {v}.",
        "The {v} flows through {e}.",
    ),
    "language": (
        "People in {e} speak {v}.",
        "The language of {e} is {v}.",
    ),
}
ATTRIBUTES: tuple[str, ...] = tuple(TEMPLATES)
SPLITS = ("train", "val")
PARTS = ("all", "pretrain", "finetune")


def _name(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(_CODAS)).capitalize()


def _unique_names(rng: random.Random, count: int, taken: set[str], lo: int, hi: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = _name(rng, rng.randint(lo, hi))
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


@dataclass(frozen=True)
class FactBase:
    """`facts[i][attr]` is the value of attribute `attr` of entity `entities[i]`."""

    entities: tuple[str, ...]
    facts: tuple[dict[str, str], ...]

    @classmethod
    def generate(cls, seed: int, num_entities: int) -> FactBase:
        if num_entities <= 0:
            raise ValueError(f"num_entities must be > 0, got {num_entities}")
        rng = random.Random(f"engram-facts/{seed}")
        taken: set[str] = set()
        entities = _unique_names(rng, num_entities, taken, 2, 3)
        cities = _unique_names(rng, num_entities, taken, 2, 3)
        rivers = _unique_names(rng, num_entities, taken, 2, 2)
        first = _unique_names(rng, max(8, num_entities // 4), taken, 1, 2)
        last = _unique_names(rng, max(8, num_entities // 4), taken, 2, 3)
        languages = [n + "ic" for n in _unique_names(rng, max(8, num_entities // 8), taken, 1, 2)]
        facts = []
        for i in range(num_entities):
            facts.append(
                {
                    "capital": cities[i],
                    "colour": rng.choice(_COLOURS),
                    "founder": f"{rng.choice(first)} {rng.choice(last)}",
                    "year": str(rng.randint(800, 2020)),
                    "export": rng.choice(_EXPORTS),
                    "animal": rng.choice(_ANIMALS),
                    "river": rivers[i],
                    "language": rng.choice(languages),
                }
            )
        return cls(tuple(entities), tuple(facts))


def entity_parts(
    fact_seed: int, num_entities: int, pretrain_fraction: float
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Entity indices of the pretrain and finetune parts: a seeded split, both non-empty."""
    if num_entities < 2:
        raise ValueError(
            f"splitting the facts into parts needs >= 2 entities, got {num_entities}: raise "
            "data.synthetic_num_entities"
        )
    order = list(range(num_entities))
    random.Random(f"engram-parts/{fact_seed}").shuffle(order)
    cut = min(num_entities - 1, max(1, round(pretrain_fraction * num_entities)))
    return tuple(sorted(order[:cut])), tuple(sorted(order[cut:]))


def part_entities(
    fact_seed: int, num_entities: int, part: str, pretrain_fraction: float
) -> Sequence[int]:
    """The entity indices of `part` (all | pretrain | finetune)."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; valid parts: {', '.join(PARTS)}")
    if part == "all":
        return range(num_entities)
    pretrain, finetune = entity_parts(fact_seed, num_entities, pretrain_fraction)
    return pretrain if part == "pretrain" else finetune


class SyntheticFacts:
    """Infinite indexable stream of fact documents: `docs[i]` for any i >= 0. `entities`
    restricts the documents to those entity indices (a part; default: all)."""

    def __init__(
        self,
        fact_seed: int,
        num_entities: int,
        stream_seed: int,
        split: str,
        entities: Sequence[int] | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        self.facts = FactBase.generate(fact_seed, num_entities)
        self.stream_seed = stream_seed
        self.split = split
        self.entities = range(num_entities) if entities is None else entities

    def __getitem__(self, index: int) -> str:
        # String seeds go through SHA-512: stable across processes and PYTHONHASHSEED.
        rng = random.Random(f"engram-doc/{self.stream_seed}/{self.split}/{index}")
        n = len(self.entities)
        sentences = []
        for entity in rng.sample(self.entities, min(n, rng.randint(1, 3))):
            attrs = rng.sample(ATTRIBUTES, rng.randint(2, len(ATTRIBUTES)))
            for attr in attrs:
                template = rng.choice(TEMPLATES[attr])
                value = self.facts.facts[entity][attr]
                sentences.append(template.format(e=self.facts.entities[entity], v=value))
        rng.shuffle(sentences)
        return " ".join(sentences)
