"""Incremental Engram table checkpoints (checkpoint.table_full_every = k > 1).

Every k-th save is a base: the usual DCP checkpoint of everything. The saves between are deltas:
the DCP checkpoint of everything except the row-sparse tables' rows and row state (their
weights, and exp_avg / exp_avg_sq / sum; a table's step count stays in it), plus one file per
rank, `table_delta.rank<r>.pt`, with the rows its optimizer updated since the previous save
(engram/optim/touched_rows.py): per table `<fqn>/rows` (GLOBAL row ids) and `<fqn>/<column>`
(weight and each row-state column) for those rows. Tensors only: read with torch's
weights-only loader.

The manifest of every save in this mode records its chain, `table_chain = {"steps": [base, ...,
this step], "manifest_crc32": {step: CRC-32 of that step's manifest.json}}`, so a resume knows
which folders it needs and that none was replaced since (a step re-saved by a resumed run has
another manifest). A resume from a delta loads the base's DCP checkpoint (resharded as any),
replays the deltas in order (each rank reads every rank's delta file and keeps the rows it owns:
any world size), then loads the step's own DCP checkpoint of everything else: bitwise the state
of the save. keep_latest_k keeps every step a kept checkpoint's chain needs. One process
(generation, export: folder.load_model_checkpoint) replays the table weights the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from engram.checkpoint.errors import CheckpointError
from engram.models.transformer import WRAPPER_PREFIXES
from engram.optim.lazy_adam import RowSparseOptimizer
from engram.optim.touched_rows import TouchedRows
from engram.rowstore.host_worker import row_store_of, wait_host_work
from engram.rowstore.streamed_columns import streamed_columns

DELTA_FILE = "table_delta.rank{}.pt"
CHAIN_KEY = "table_chain"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _clean(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass
class _Table:
    fqn: str  # as in the model's state dict (DCP's key)
    param: nn.Parameter
    optimizer: RowSparseOptimizer

    def offset(self) -> int:
        """The global id of this rank's first row."""
        p = self.param
        if not isinstance(p, DTensor):
            return 0
        return int(
            compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0]
        )

    def rows(self) -> int:
        return _local(self.param).shape[0]

    def read(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """{column: its rows `rows`} (weight and row state), copies on the CPU."""
        store = row_store_of(self.param)
        if store is not None:
            return store.read_columns(rows) if rows.numel() else {}
        state = self.optimizer.state[self.param]
        columns = {"weight": _local(self.param)}
        columns |= {k: _local(state[k]) for k in self.optimizer.ROW_STATE if k in state}
        return {k: v.index_select(0, rows.to(v.device)).cpu() for k, v in columns.items()}

    @torch.no_grad()
    def write(self, rows: torch.Tensor, columns: dict[str, torch.Tensor]) -> None:
        store = row_store_of(self.param)
        if store is not None:
            store.write_columns(rows, columns)
            return
        state = self.optimizer.state[self.param]
        if not state:  # a table first updated after the base
            self.optimizer._init_state(self.param, state, tensors=True)
        targets = {"weight": _local(self.param)} | {
            k: _local(state[k]) for k in self.optimizer.ROW_STATE
        }
        for name, values in columns.items():
            t = targets[name]
            t.index_copy_(0, rows.to(t.device), values.to(t.device, t.dtype))


class WithoutTables(Stateful):
    """A state whose state dict leaves out the table keys (a delta's DCP part); loading it
    keeps the current table values (replayed from base + deltas) and sets the rest. Row-store
    (NVMe) tables' columns are never read out for it: their state dicts hold placeholders
    (engram/rowstore/streamed_columns.py), left out, or handed back to the load unchanged."""

    def __init__(self, inner: Any, drop: Callable[[str], bool]) -> None:
        self.inner, self.drop = inner, drop

    def state_dict(self) -> dict[str, Any]:
        with streamed_columns():
            return {k: v for k, v in self.inner.state_dict().items() if not self.drop(k)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with streamed_columns():
            self.inner.load_state_dict({**self.inner.state_dict(), **state_dict})


class TableDeltas:
    """The row-sparse tables of a model (pipeline parts) and their optimizers: what a delta
    leaves out of DCP, writes per rank and replays."""

    def __init__(self, parts: Sequence[nn.Module], optimizers: Sequence[Any]) -> None:
        sparse = [o for o in optimizers if isinstance(o, RowSparseOptimizer)]
        owner = {id(p): o for o in sparse for g in o.param_groups for p in g["params"]}
        self.tables: list[_Table] = []
        for part in parts:
            for name, p in part.named_parameters():
                if id(p) in owner:
                    self.tables.append(_Table(_clean(name), p, owner[id(p)]))
        self._keys = {t.fqn for t in self.tables} | {
            f"state.{t.fqn}.{k}" for t in self.tables for k in t.optimizer.ROW_STATE
        }
        self.touched: TouchedRows | None = None

    def track(self) -> None:
        """Record every row the optimizers update from now on."""
        self.touched = TouchedRows()
        for t in self.tables:
            t.optimizer.touched = self.touched

    def reset(self) -> None:
        """A full save or a load: the record starts again."""
        if self.touched is not None:
            self.touched.clear()

    def drop(self, key: str) -> bool:
        """True for a model / flattened optimizer state key that a delta's DCP part leaves out."""
        return key in self._keys

    def without_tables(self, states: dict[str, Any]) -> dict[str, Any]:
        return {k: WithoutTables(v, self.drop) for k, v in states.items()}

    def write_delta(self, folder: Path, rank: int) -> int:
        """Write this rank's touched rows (global ids) and their state; returns the row count."""
        if self.touched is None:
            raise RuntimeError("a table delta needs TableDeltas.track() from the start")
        wait_host_work()  # queued host updates write the rows
        out: dict[str, torch.Tensor] = {}
        count = 0
        for t in self.tables:
            rows = self.touched.take(t.param)
            out[f"{t.fqn}/rows"] = rows + t.offset()
            for name, values in t.read(rows).items():
                out[f"{t.fqn}/{name}"] = values.contiguous()
            count += rows.numel()
        torch.save(out, folder / DELTA_FILE.format(rank))
        return count

    def apply(self, folder: Path, saved_world: int) -> None:
        """Replay the delta files of checkpoint `folder` (saved by `saved_world` ranks): each
        table keeps the rows of its own shard."""
        wait_host_work()
        seen: set[str] = set()
        for k in range(saved_world):
            file = folder / DELTA_FILE.format(k)
            try:
                delta = torch.load(file, weights_only=True, mmap=True)
            except (OSError, RuntimeError) as e:
                raise CheckpointError(
                    f"table delta {file} cannot be read: {e}. Resume from the chain's base step "
                    "or an older checkpoint (checkpoint.load_step)"
                ) from None
            for t in self.tables:
                if f"{t.fqn}/rows" not in delta:  # a rank of another pipeline stage
                    continue
                seen.add(t.fqn)
                rows = delta[f"{t.fqn}/rows"]
                lo = t.offset()
                mine = (rows >= lo) & (rows < lo + t.rows())
                if not bool(mine.any()):
                    continue
                columns = {
                    c: v[mine]
                    for key, v in delta.items()
                    if (c := key.partition("/")[2]) != "rows" and key.startswith(f"{t.fqn}/")
                }
                t.write(rows[mine] - lo, columns)
        missing = [t.fqn for t in self.tables if t.fqn not in seen]
        if missing:
            raise CheckpointError(
                f"the table deltas of {folder} hold no rows of tables {missing[:3]}: they were "
                "written by another model. Resume from a base step (checkpoint.load_step)"
            )


@torch.no_grad()
def replay_table_weights(model: nn.Module, folders: Sequence[Path]) -> set[str]:
    """One process, an unsharded `model` (generation, export): write the table rows of the
    delta checkpoints `folders` (in order) into its parameters; returns the tables' names."""
    tables: set[str] = set()
    for folder in folders:
        for file in sorted(folder.glob("table_delta.rank*.pt")):
            delta = torch.load(file, weights_only=True, mmap=True)
            for key, rows in delta.items():
                if key.endswith("/rows"):
                    fqn = key[: -len("/rows")]
                    weight = model.get_parameter(fqn)
                    weight.index_copy_(0, rows, delta[f"{fqn}/weight"].to(weight.dtype))
                    tables.add(fqn)
    return tables


def chain_of(manifest: dict[str, Any], step: int) -> list[int]:
    """The steps a checkpoint's tables need, base first (a full checkpoint: [step])."""
    chain = manifest.get(CHAIN_KEY)
    return [int(s) for s in chain["steps"]] if chain else [step]


def chain_record(steps: list[int], manifest_crc: Callable[[int], str]) -> dict[str, Any]:
    """The manifest entry of a save whose tables need `steps` (base first, itself last)."""
    return {"steps": steps, "manifest_crc32": {str(s): manifest_crc(s) for s in steps[:-1]}}


def chain_problems(
    path: Path,
    manifest: dict[str, Any],
    step_dir: Callable[[int], Path],
    manifest_crc: Callable[[Path], str | None],
    verify: Callable[[Path], list[str]],
) -> list[str]:
    """Problems of the steps checkpoint `path`'s tables need (empty: all there, unchanged and
    intact), each naming the step, the file and the fix."""
    chain = manifest.get(CHAIN_KEY)
    if not chain or len(chain["steps"]) < 2:
        return []
    steps = [int(s) for s in chain["steps"]]
    base = steps[0]
    fix = (
        f"Fix: restore it, or resume from the base step-{base} (checkpoint.load_step = {base}) "
        "or another step whose chain is intact"
    )
    head = f"checkpoint {path} holds its tables as deltas on base step-{base} (steps {steps})"
    problems = []
    for s in steps[:-1]:
        kind = "its base" if s == base else "a delta"
        folder = step_dir(s)
        crc = manifest_crc(folder)
        if crc is None:
            problems.append(f"{head}: it needs step-{s} ({kind}), whose folder {folder} or "
                            f"manifest is missing. {fix}")  # fmt: skip
            continue
        if crc != chain["manifest_crc32"].get(str(s)):
            problems.append(
                f"{head}: step-{s} ({kind}) was replaced since (another manifest: a resumed run "
                f"saved that step again). {fix}"
            )
            continue
        problems += [f"{head}: it needs step-{s} ({kind}): {p}. {fix}" for p in verify(folder)]
    return problems
