"""Resumable data loader that delivers packed sequences plus Engram hash ids, per DP rank.

Sharding is by GLOBAL sample index: the packed sample stream is one sequence for the whole job,
the k-th global batch after position p holds samples [p + k*G, p + (k+1)*G) with
G = dp_world * local_batch, and data-parallel rank r takes rows [r*b, (r+1)*b) of it. Loader
worker w produces the batches k with k % num_workers == w (the DataLoader reads its workers
round-robin). So a batch depends only on (data, seed, seq_len, global batch, position), never on
dp_world or num_workers, and the loader state is GLOBAL and PLAIN (see `DataLoader.state_dict`):
a few integers and strings, restorable at any dp size and any num_workers.

Cost per rank, by source:
- `tokens` (prepared shards, tokens.py): sample j is computed by index, so a (rank, worker) reads
  and hashes only its own b rows per batch: O(local batch), independent of the world size.
- `synthetic_facts` / `text` / `jsonl` (small data): a packed stream of documents tokenised on the
  fly; every (rank, worker) tokenises the whole global stream and keeps its rows, so each loader
  process must keep up with the GLOBAL token rate. Fine for small jobs; switch to `tokens` (see
  README) when dp_world * local_batch * seq_len tokens per step gets large (benchmarks.md).
- `chat` / `synthetic_chat` (fine-tuning, chat_dataset.py / sft.py): conversations encoded once
  per process at start (records on disk) or mapped (a prepared chat folder), packed into rows by
  a plan made at start; sample j is computed by index like `tokens`: O(local batch) per step.

Hash ids are computed in the collate function, i.e. in the worker processes, vectorised over the
whole [B, T] batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import IterableDataset, get_worker_info

from engram.config import JobConfig
from engram.config.training import CHAT_DATASETS
from engram.data.datasets import DocumentSource, build_documents
from engram.data.packing import TokenStream, make_sample
from engram.data.shards import tokenizer_fingerprint
from engram.data.tokenizer import Tokenizer
from engram.data.tokens import TokenMixture

STATE_FORMAT = "engram-loader/1"
Sample = dict[str, np.ndarray]


class Hasher(Protocol):
    def __call__(
        self, input_ids: np.ndarray, segment_ids: np.ndarray | None = None
    ) -> np.ndarray: ...


class StreamSource:
    """Packed stream of an on-the-fly tokenised document source; position = (doc, offset)."""

    def __init__(self, docs: DocumentSource, encode, eos_id: int, seq_len: int, fingerprint: str):
        self.docs, self.encode, self.eos_id = docs, encode, eos_id
        self.chunk = seq_len + 1
        self.fingerprint = fingerprint

    def start(self) -> dict[str, int]:
        return {"sample": 0, "doc": 0, "offset": 0}

    def reader(self, position: dict[str, int]) -> StreamReader:
        return StreamReader(self, position)

    def samples_per_source(self, consumed: int) -> dict[str, int]:
        return {}


class StreamReader:
    """Cursor over a StreamSource; reads must move forward (they do: batches go in order)."""

    def __init__(self, source: StreamSource, position: dict[str, int]) -> None:
        self.source = source
        self.sample = int(position["sample"])
        self.stream = TokenStream(
            source.docs, source.encode, source.eos_id, int(position["doc"]), int(position["offset"])
        )

    def _seek(self, sample: int) -> None:
        if sample < self.sample:
            raise RuntimeError(
                f"stream reader cannot go back from sample {self.sample} to {sample}"
            )
        self.stream.skip((sample - self.sample) * self.source.chunk)
        self.sample = sample

    def read(self, first: int, count: int) -> list[Sample]:
        self._seek(first)
        out = [
            make_sample(self.stream.take(self.source.chunk), self.source.eos_id)
            for _ in range(count)
        ]
        self.sample += count
        return out

    def position(self, sample: int) -> dict[str, int]:
        self._seek(sample)
        return {"sample": sample, "doc": self.stream.doc, "offset": self.stream.offset}


class TokenSource:
    """Prepared token shards (a mixture of folders); position = the global sample index."""

    def __init__(self, mixture: TokenMixture) -> None:
        self.mixture = mixture
        self.fingerprint = mixture.fingerprint

    def start(self) -> dict[str, int]:
        return {"sample": 0}

    def reader(self, position: dict[str, int]) -> TokenSource:
        return self

    def read(self, first: int, count: int) -> list[Sample]:
        return self.mixture.samples(first, count)

    def position(self, sample: int) -> dict[str, int]:
        return {"sample": sample}

    def samples_per_source(self, consumed: int) -> dict[str, int]:
        return self.mixture.samples_per_source(consumed)


class PackedDataset(IterableDataset):
    """Local batches of one DP rank: yields (b sample dicts, position after that global batch).

    Starts at `self.position` (a global position; the DataLoader below keeps it at the
    consumed position); worker w of W yields global batches w, w + W, ... from there.
    """

    def __init__(self, source, seq_len: int, local_batch: int, dp_rank: int = 0, dp_world: int = 1):
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank must be in [0, {dp_world}), got {dp_rank}")
        if seq_len <= 0 or local_batch <= 0:
            raise ValueError("seq_len and local_batch must be > 0")
        self.source = source
        self.seq_len = seq_len
        self.local_batch = local_batch
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.global_batch = dp_world * local_batch
        self.position = source.start()

    def __iter__(self) -> Iterator[tuple[list[Sample], dict[str, int]]]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        reader = self.source.reader(dict(self.position))
        base, g, b = int(self.position["sample"]), self.global_batch, self.local_batch
        k = worker
        while True:
            first = base + k * g
            rows = reader.read(first + self.dp_rank * b, b)
            yield rows, reader.position(first + g)
            k += num_workers


class Collate:
    """Stacks a rank's samples into int64 tensors and adds Engram hash ids for the whole batch."""

    def __init__(self, hasher: Hasher | None, respect_doc_boundaries: bool) -> None:
        self.hasher = hasher
        self.respect_doc_boundaries = respect_doc_boundaries

    def __call__(self, item: tuple[list[Sample], dict[str, int]]) -> dict[str, Any]:
        samples, position = item
        arrays = {k: np.stack([s[k] for s in samples]) for k in samples[0]}
        if self.hasher is not None:
            seg = arrays["segment_ids"] if self.respect_doc_boundaries else None
            arrays["hash_ids"] = np.ascontiguousarray(
                self.hasher(arrays["input_ids"], seg), dtype=np.int64
            )
        batch: dict[str, Any] = {k: torch.from_numpy(v) for k, v in arrays.items()}
        batch["position"] = position
        return batch


class DataLoader:
    """Infinite loader of one rank's batches with a global, plain, JSON-able state.

    `state_dict()` is the position after the batches consumed so far (not merely prefetched):
    {"format": "engram-loader/1", "dataset": ..., "fingerprint": ..., "seed": ...,
     "seq_len": T, "global_batch": G, "batches": n, "position": {"sample": s[, "doc", "offset"]}}
    where s is the number of global samples consumed (and doc/offset the packed-stream cursor of
    the on-the-fly sources at s). Loading it at any dp size and num_workers makes the next global
    batch samples [s, s + G'): with the same global batch G, exactly the batch the saving run
    would have produced next. Each iter() starts at the current position.

    Read-ahead (the training loop takes step N+1's batches while step N runs, so their hash ids
    are known a step early): `hold()` before reading ahead keeps `state_dict()` (and
    `samples_per_source()`) at the position as of the hold, the batches consumed by completed
    steps, until `release()` when the step that takes the batches read ahead starts; a
    checkpoint saved in between resumes at exactly the batches the next step would have seen.
    """

    def __init__(self, dataset: PackedDataset, collate: Collate, num_workers: int, meta: dict):
        self.dataset = dataset
        self.collate = collate
        self.num_workers = num_workers
        self.meta = meta  # dataset, fingerprint, seed, seq_len
        self.batches = 0
        self._held: tuple[int, dict[str, int]] | None = None  # (batches, position) at hold()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        loader = TorchDataLoader(
            self.dataset, batch_size=None, collate_fn=self.collate, num_workers=self.num_workers
        )
        for batch in loader:
            self.dataset.position = batch.pop("position")
            self.batches += 1
            yield batch

    def hold(self) -> None:
        """Batches read from now on are read ahead: the state stays as of now until release."""
        if self._held is None:
            self._held = (self.batches, dict(self.dataset.position))

    def release(self) -> None:
        """The batches read ahead are being consumed: the state is the current position again."""
        self._held = None

    def state_dict(self) -> dict[str, Any]:
        batches, position = self._held or (self.batches, self.dataset.position)
        return {
            "format": STATE_FORMAT,
            **self.meta,
            "global_batch": self.dataset.global_batch,
            "batches": batches,
            "position": dict(position),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"data loader state {str(state)[:80]!r} is not an {STATE_FORMAT} state (saved by "
                "another version?): resume without loading the data position"
            )
        for key, value in self.meta.items():
            if state.get(key) != value:
                raise ValueError(
                    f"data loader state was saved with {key}={state.get(key)!r}, this run has "
                    f"{value!r}: resume with the same data, job.seed and training.seq_len, or "
                    "start without loading the data position"
                )
        position = {k: int(v) for k, v in state["position"].items()}
        if set(position) != set(self.dataset.source.start()):
            raise ValueError(f"data loader state position {position} does not fit {self.meta}")
        self.dataset.position = position
        self.batches = int(state["batches"])
        self._held = None

    def samples_per_source(self) -> dict[str, int]:
        """Global samples consumed so far per mixture source (tokens dataset; else {})."""
        position = self._held[1] if self._held else self.dataset.position
        return self.dataset.source.samples_per_source(int(position["sample"]))


def _docs_fingerprint(job_cfg: JobConfig, split: str, docs: DocumentSource) -> str:
    data = job_cfg.data
    if data.dataset == "synthetic_facts":
        text = f"synthetic_facts/{data.synthetic_seed}/{data.synthetic_num_entities}/{split}"
        if data.synthetic_part != "all":
            text += f"/{data.synthetic_part}/{data.synthetic_pretrain_fraction}"
    else:  # small in-memory file datasets: hash their documents
        h = hashlib.sha256(split.encode())
        for doc in docs.docs:
            h.update(doc.encode())
            h.update(b"\0")
        text = h.hexdigest()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_dataset(
    job_cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_world: int, split: str = "train"
) -> PackedDataset:
    data, seq_len, seed = job_cfg.data, job_cfg.training.seq_len, job_cfg.job.seed
    if data.dataset == "tokens":
        sources = data.token_sources
        mixture = TokenMixture(
            [s.path for s in sources],
            [s.weight for s in sources],
            tokenizer_fingerprint(tokenizer),
            tokenizer.vocab_size,
            seq_len,
            split,
            seed,
        )
        source: Any = TokenSource(mixture)
    elif data.dataset in CHAT_DATASETS:
        from engram.data.chat_dataset import build_chat_samples  # jinja2 / pyarrow: chat only

        source = TokenSource(build_chat_samples(job_cfg, tokenizer, split))
    else:
        docs = build_documents(data, split, seed)
        fp = _docs_fingerprint(job_cfg, split, docs)
        source = StreamSource(docs, tokenizer.encode, tokenizer.eos_id, seq_len, fp)
    return PackedDataset(source, seq_len, job_cfg.training.local_batch_size, dp_rank, dp_world)


def build_dataloader(
    job_cfg: JobConfig,
    tokenizer: Tokenizer,
    hasher: Hasher | None,
    dp_rank: int,
    dp_world: int,
    split: str = "train",
) -> DataLoader:
    """Infinite loader of batches {input_ids, labels, segment_ids[, hash_ids]} for one DP rank.

    input_ids/labels/segment_ids: int64 [B, T]; hash_ids: int64 [B, T, L, H] (absent when
    `hasher` is None). B = training.local_batch_size, T = training.seq_len. `split` is "train"
    or "val" (held-out); build a fresh "val" loader per evaluation to score the same batches.
    """
    dataset = build_dataset(job_cfg, tokenizer, dp_rank, dp_world, split)
    meta = {
        "dataset": job_cfg.data.dataset,
        "fingerprint": dataset.source.fingerprint,
        "seed": job_cfg.job.seed,
        "seq_len": job_cfg.training.seq_len,
    }
    # Chat data always keeps n-grams inside a conversation (its segments are conversations).
    boundaries = job_cfg.engram.respect_doc_boundaries or job_cfg.data.dataset in CHAT_DATASETS
    return DataLoader(
        dataset,
        Collate(hasher, boundaries),
        job_cfg.data.num_workers,
        meta,
    )
