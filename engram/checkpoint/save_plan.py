"""What one save writes, as a plan: the seam between the checkpoint manager (when to save, which
kind of save) and the writer (writer.py: how any save is written and committed).

A `SavePlan` lists the parts a save writes into its `step-<N>.tmp/` folder and the record its
commit adds (meta.json, fingerprint.json, the manifest's table chain). Two kinds of part:

    shared   collective writers every rank runs together (DCP, a DeepSpeed engine's folder
             state): an error raises on every rank at once
    local    this rank's own files (JSON states, a table delta's rows): an OSError is gathered,
             so every rank raises together, naming the path and the free space

The plans (`full_save`, `table_delta_save`) are built from the same `SaveInputs`; how DCP
writes is a part of its own, chosen by whether the save blocks:

    StreamedDcp   a blocking save: NVMe tables' columns stream from their stores one chunk at a
                  time (streamed_dcp.py)
    StagedDcp     an async save (checkpoint.async_mode = "async"): DCP stages the state in host
                  memory and writes in the background; committed by the next save or wait()

A new kind of save (another file in the step folder, another way to write the tables) is a new
part and a plan that lists it, not a branch in the writer.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed.checkpoint as dcp

from engram.checkpoint.dcp_io import TensorsOnlySavePlanner
from engram.checkpoint.folder import write_json
from engram.checkpoint.streamed_dcp import StreamedSavePlanner, StreamedWriter
from engram.checkpoint.table_delta import TableDeltas
from engram.rowstore.streamed_columns import streamed_columns


class SavePart(Protocol):
    """One thing a save writes into its step's temporary folder; every rank calls `write`, in
    the plan's order. Returns a future when the files are finished in the background."""

    def write(self, tmp: Path, rank: int) -> Future | None: ...


@dataclass
class SavePlan:
    """One save of step `step`: its parts (the module docstring), then its record."""

    step: int
    shared: list[SavePart]
    local: list[SavePart]
    chain: list[int]  # the table chain the committed save holds, base step first ([step]: full)
    record_chain: bool  # incremental tables: the manifest records the chain
    meta: dict[str, Any]  # meta.json but its time (added at the commit)
    fingerprint: dict[str, Any]  # fingerprint.json
    dirs: frozenset[str]  # the sub-folders the parts write: a leftover of ours may hold them
    keep: int  # checkpoint.keep_latest_k: pruned after the commit


@dataclass
class SaveInputs:
    """What a plan is built from: the manager's states and settings as they are at this save."""

    dcp_state: dict[str, Any]  # Stateful objects saved through DCP (one copy of global values)
    json_states: dict[str, Any]  # name -> object with a JSON state_dict, written per rank
    folder_states: dict[str, Any]  # name -> object that saves itself into tmp/<name>/
    meta: dict[str, Any]  # meta.json but its step and time
    fingerprint: dict[str, Any]
    keep: int  # checkpoint.keep_latest_k
    async_group: Callable[[], Any]  # the process group of a background save (None: default)
    tables: TableDeltas | None = None  # incremental table checkpoints (table_full_every > 1)


# -- parts


@dataclass
class StreamedDcp:
    state: dict[str, Any]

    def write(self, tmp: Path, rank: int) -> None:
        # NVMe tables' columns stream from their stores one chunk at a time (streamed_dcp.py)
        with streamed_columns():
            dcp.save(self.state, storage_writer=StreamedWriter(str(tmp)),
                     planner=StreamedSavePlanner())  # fmt: skip


@dataclass
class StagedDcp:
    state: dict[str, Any]
    group: Callable[[], Any]  # created at the first async save, on every rank

    def write(self, tmp: Path, rank: int) -> Future:
        # An async save copies the state dict to host memory before it returns (the training
        # step may change it then): NVMe tables' columns are read out whole.
        response = dcp.async_save(
            self.state,
            checkpoint_id=str(tmp),
            process_group=self.group(),
            planner=TensorsOnlySavePlanner(),
        )
        return getattr(response, "upload_completion", response)


@dataclass
class FolderStates:
    """Objects that write their own files into `tmp/<name>/` (a DeepSpeed engine), collective."""

    states: dict[str, Any]

    def write(self, tmp: Path, rank: int) -> None:
        for name, obj in self.states.items():
            obj.save(tmp / name)


@dataclass
class JsonStates:
    """`<name>.rank<k>.json` per state (the data loader, RNG)."""

    states: dict[str, Any]

    def write(self, tmp: Path, rank: int) -> None:
        for name, obj in self.states.items():
            try:
                write_json(tmp / f"{name}.rank{rank}.json", obj.state_dict())
            except TypeError as e:
                raise TypeError(f"checkpoint state {name!r} is not JSON-serialisable: {e}") from e


@dataclass
class TableRows:
    """A table delta: this rank's rows touched since the previous save, and their state."""

    tables: TableDeltas

    def write(self, tmp: Path, rank: int) -> None:
        self.tables.write_delta(tmp, rank)


@dataclass
class TableChainStart:
    """A full save of incremental tables: the touched-row record starts again."""

    tables: TableDeltas

    def write(self, tmp: Path, rank: int) -> None:
        self.tables.reset()


# -- plans


def full_save(step: int, inputs: SaveInputs, blocking: bool) -> SavePlan:
    """Every state whole; with incremental tables the base of a new chain."""
    restart = [TableChainStart(inputs.tables)] if inputs.tables is not None else []
    return _plan(step, inputs, blocking, [step], inputs.dcp_state, restart)


def table_delta_save(step: int, inputs: SaveInputs, blocking: bool, chain: list[int]) -> SavePlan:
    """The tables' rows updated since the previous save of `chain` (per-rank files, replayed on
    the chain's base at load: table_delta.py), every other state through DCP as in a full save."""
    tables = inputs.tables
    if tables is None:
        raise ValueError("a table delta needs incremental tables (checkpoint.table_full_every > 1)")
    dcp_state = tables.without_tables(inputs.dcp_state)
    return _plan(step, inputs, blocking, [*chain, step], dcp_state, [TableRows(tables)])


def _plan(
    step: int,
    inputs: SaveInputs,
    blocking: bool,
    chain: list[int],
    dcp_state: dict[str, Any],
    tables: list[SavePart],
) -> SavePlan:
    """DCP first (an async save stages the state before anything else runs), the folder states,
    then the per-rank files: the tables' part, the JSON states."""
    dcp_write = StreamedDcp(dcp_state) if blocking else StagedDcp(dcp_state, inputs.async_group)
    return SavePlan(
        step,
        shared=[dcp_write, FolderStates(inputs.folder_states)],
        local=[*tables, JsonStates(inputs.json_states)],
        chain=chain,
        record_chain=inputs.tables is not None,
        meta={**inputs.meta, "step": step},
        fingerprint=inputs.fingerprint,
        dirs=frozenset(inputs.folder_states),
        keep=inputs.keep,
    )
