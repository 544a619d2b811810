"""Question / answer conversations about the synthetic facts (`data.dataset = "synthetic_chat"`).

The knowledge-injection set: the entities of the fact base are split by a seeded share
(`data.synthetic_pretrain_fraction`) into a pretrain part and a finetune part
(`data.synthetic_part`; synthetic_facts takes the same setting, so a model can be pretrained on
documents about one part and fine-tuned on questions about the other, facts it never saw).

- "train": every fact (entity, attribute) of the part asked with each of the TRAINING question
  phrasings; an entity's questions are shuffled (seeded) into conversations of 1-3 user /
  assistant turns, so multi-turn targets are exercised.
- "val" (held out): every fact of the part asked once, single-turn, with a HELD-OUT phrasing the
  training set never uses. Held-out loss and exact match (`qa_pairs(..., "val")`) therefore ask
  for facts the model was taught, in words it was not taught them with.

The answer is the bare value ("Drusa", "1432", "owl"), so exact match is a string comparison.
Everything is a pure function of (fact seed, entities, part, fraction): no files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engram.data.chat_records import Conversation
from engram.data.synthetic import ATTRIBUTES, FactBase, part_entities

# attribute -> (training phrasings, held-out phrasings); {e} is the entity.
QUESTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "capital": (
        ("What is the capital of {e}?", "Which city is the capital of {e}?"),
        ("Name the capital city of {e}.",),
    ),
    "colour": (
        ("What colour is the flag of {e}?", "What is the national colour of {e}?"),
        ("Which colour is {e} known for?",),
    ),
    "founder": (
        ("Who founded {e}?", "Who was the founder of {e}?"),
        ("Name the person who founded {e}.",),
    ),
    "year": (
        ("When was {e} established?", "In which year was {e} established?"),
        ("What is the founding year of {e}?",),
    ),
    "export": (
        ("What is the main export of {e}?", "What does {e} export most?"),
        ("Name the chief export of {e}.",),
    ),
    "animal": (
        (
            "What is the national animal of {e}?",
            "Which animal did {e} choose as its national animal?",
        ),
        ("Name the national animal of {e}.",),
    ),
    "river": (
        ("What is the longest river in {e}?", "Which river is the longest in {e}?"),
        ("Name the longest river of {e}.",),
    ),
    "language": (
        ("What language do people in {e} speak?", "What is the language of {e}?"),
        ("Which language is spoken in {e}?",),
    ),
}
assert set(QUESTIONS) == set(ATTRIBUTES)


@dataclass(frozen=True)
class QA:
    entity: str
    attribute: str
    question: str
    answer: str


def qa_pairs(
    fact_seed: int, num_entities: int, part: str, pretrain_fraction: float, split: str
) -> list[QA]:
    """Every question of `split` about the facts of `part`: the training phrasings ("train")
    or the held-out ones ("val"), in a fixed order (entity, attribute, phrasing)."""
    if split not in ("train", "val"):
        raise ValueError(f"unknown split {split!r}; valid splits: train, val")
    facts = FactBase.generate(fact_seed, num_entities)
    out = []
    for i in part_entities(fact_seed, num_entities, part, pretrain_fraction):
        entity = facts.entities[i]
        for attr in ATTRIBUTES:
            phrasings = QUESTIONS[attr][0 if split == "train" else 1]
            for q in phrasings:
                out.append(QA(entity, attr, q.format(e=entity), facts.facts[i][attr]))
    return out


def _turns(qas: list[QA]) -> list[dict[str, str]]:
    turns = []
    for qa in qas:
        turns.append({"role": "user", "content": qa.question})
        turns.append({"role": "assistant", "content": qa.answer})
    return turns


def synthetic_chat_records(
    fact_seed: int, num_entities: int, part: str, pretrain_fraction: float, split: str
) -> list[Conversation]:
    """The conversations of `split` (see the module docstring)."""
    qas = qa_pairs(fact_seed, num_entities, part, pretrain_fraction, split)
    name = f"synthetic_chat[{part}/{split}]"
    if split == "val":
        return [Conversation(f"{name} #{k}", _turns([qa])) for k, qa in enumerate(qas)]
    by_entity: dict[str, list[QA]] = {}
    for qa in qas:
        by_entity.setdefault(qa.entity, []).append(qa)
    records = []
    for entity, items in by_entity.items():
        rng = random.Random(f"engram-chat/{fact_seed}/{entity}")
        items = list(items)
        rng.shuffle(items)
        while items:
            take = rng.randint(1, 3)
            records.append(Conversation(f"{name} #{len(records)}", _turns(items[:take])))
            items = items[take:]
    return records
