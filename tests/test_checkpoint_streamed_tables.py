"""Streamed NVMe table checkpoints (engram/rowstore/streamed_columns.py, engram/checkpoint/
streamed_dcp.py): a full save reads an NVMe table's columns out of its store one row chunk at
a time (at most CHUNK_BYTES of table data in host memory), a table delta's DCP part reads none
of them, and a resume writes the stored chunks into the store. Counted on the stores (every
column read out: `snapshot` / `read_range`) and on the save planner; the checkpoint (saved in
chunks) resumes bitwise with NVMe tables at another world size and with device tables."""

from __future__ import annotations

import numpy as np
import pytest
from launcher import in_turn, run_distributed
from test_checkpoint_table_delta import _job
from test_parallelisms_host_tables import _same
from test_parallelisms_nvme_tables import _train as _nvme_train

CHUNK = 64 << 10  # small chunks: a rank's column (~800 KB) is written in ~13


def _counted_train(rank: int, world: int, raw: dict) -> dict:
    """Train; per save: the largest column piece a store returned (`snapshot` or `read_range`,
    whichever the code has), the bytes all stores returned, and the save planner's peak of
    table chunks held at once; the largest write of rows into a store (here: the init)."""
    import engram.checkpoint.manager as manager
    import engram.models.init as init
    import engram.rowstore.streamed_columns as sc
    from engram.checkpoint.streamed_dcp import StreamedWriter
    from engram.rowstore.nvme_store import NvmeRowStore

    sc.CHUNK_BYTES = CHUNK
    init.CHUNK_NUMEL = CHUNK // 4  # the init's chunks too (its values change alike everywhere)
    loads: list[int] = []  # bytes of each write of whole rows into a store (init, resume)
    load = NvmeRowStore.load

    def counted_load(self, values, *args, **kwargs):
        loads.append(sum(v.nbytes for v in values.values()))
        return load(self, values, *args, **kwargs)

    NvmeRowStore.load = counted_load
    reads: list[int] = []
    for name in ("snapshot", "read_range"):
        original = getattr(NvmeRowStore, name, None)
        if original is None:
            continue

        def counted(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            reads.append(out.nbytes)
            return out

        setattr(NvmeRowStore, name, counted)
    saves = []
    save_into = manager.CheckpointManager._save_into

    def measured(self, step, tmp, final, blocking=True):
        reads.clear()
        out = save_into(self, step, tmp, final, blocking)
        files = list(tmp.glob("table_delta.rank*.pt")) or list(final.glob("table_delta.rank*.pt"))
        saves.append({"step": step, "delta": bool(files), "largest": max(reads, default=0),
                      "total": sum(reads)})  # fmt: skip
        return out

    manager.CheckpointManager._save_into = measured
    held = []  # the save planner's most table bytes held at once, and at the end
    write_data = StreamedWriter.write_data

    def recorded(self, plan, planner):
        out = write_data(self, plan, planner)
        held.append((planner.peak_bytes, planner.live_bytes))
        return out

    StreamedWriter.write_data = recorded
    result = _nvme_train(rank, world, raw)
    result["saves"] = saves
    result["held"] = held
    result["loads"] = loads
    result["shard_column"] = max(s["table"] for s in result["stores"]) if result["stores"] else 0
    return result


def _run(tmp, world, steps, full_every, location="nvme", load_step=-1):
    raw = _job(tmp, "stream", world, steps, full_every, load_step=load_step)
    raw["job"]["run_name"] = "stream"
    raw["engram"]["table_location"] = location
    if location == "nvme":
        raw["engram"] |= {"nvme_dirs": [str(tmp / f"pages{load_step}_{world}")],
                          "nvme_create_dirs": True,
                          "nvme_host_cache_gib": 5 / 1024 / world}  # fmt: skip
    return raw


@pytest.mark.slow
def test_streamed_saves_hold_a_chunk_and_resume_bitwise(tmp_path):
    """2 ranks, NVMe tables, 4 steps saved at every step with a base every 2 saves (1 and 3
    full, 2 and 4 deltas). A full save reads no column piece above CHUNK_BYTES (whole-column
    snapshots read each rank's whole shard column: ~13x that); a delta save reads no column at
    all (its touched rows come through the delta file); the init writes the store in chunks
    of the layout-independent init (here 64 KiB), not the shard at once. Resumed from full step 3 with NVMe
    tables by 1 rank: step 4 equals the same resume with device tables; by 2 ranks with device
    tables: equal to the uninterrupted run."""
    whole = run_distributed(_counted_train, 2, _run(tmp_path, 2, 4, 2))
    for rank, got in enumerate(whole):
        assert [s["step"] for s in got["saves"]] == [1, 2, 3, 4]
        print(f"rank {rank}: a shard column {got['shard_column']} B, chunk {CHUNK} B:",
              [(s["step"], "delta" if s["delta"] else "full", s["largest"], s["total"])
               for s in got["saves"]])  # fmt: skip
        assert got["shard_column"] >= 8 * CHUNK
        for s in got["saves"]:
            if s["delta"]:
                assert s["total"] == 0, s  # the DCP part materialises no table column
            else:
                assert 0 < s["largest"] <= CHUNK, s  # one chunk at a time, not a column
                assert s["total"] >= 3 * got["shard_column"], s  # weight + 2 moments, all rows
        # the init wrote the shard into the store chunk by chunk, never whole
        assert got["loads"] and max(got["loads"]) <= CHUNK < got["shard_column"], got["loads"]
        # every save (full and delta): at most one chunk held at once, none left at the end
        assert len(got["held"]) == 4 and all(0 <= p <= CHUNK and n == 0 for p, n in got["held"])
        assert max(p for p, _ in got["held"]) == CHUNK
    resumed = {(2, "device"): run_distributed(
        _nvme_train, 2, _run(tmp_path, 2, 4, 1, "device", load_step=3))}  # fmt: skip
    ones = [_run(tmp_path, 1, 4, 1, location, load_step=3) for location in ("nvme", "device")]
    ((nvme, device),) = run_distributed(in_turn, 1, _nvme_train, ones)  # one launch, in turn
    resumed[1, "nvme"], resumed[1, "device"] = [nvme], [device]
    # 2 ranks: like the uninterrupted run; 1 rank: NVMe like device tables (the same resume)
    for label, got_all, want_all, first in (
        ("2 ranks, device tables", resumed[2, "device"], whole, 3),
        ("1 rank, NVMe tables", resumed[1, "nvme"], resumed[1, "device"], 0),
    ):
        for got, want in zip(got_all, want_all, strict=True):
            assert len(got["losses"]) == 1, (label, got["losses"])
            assert _same(got["losses"], want["losses"][first:]), (label, got["losses"])
            assert got["tables"].keys() == want["tables"].keys() and got["tables"]
            for n, t in want["tables"].items():
                assert np.array_equal(got["tables"][n], t), f"{label}: {n} differs"


@pytest.mark.slow
def test_async_saves_of_nvme_tables_resume_bitwise(tmp_path):
    """checkpoint.async_mode = "async" with NVMe tables (1 rank, 4 steps, a base every 2
    saves): a full save stages the columns read out whole, a delta's DCP part none; resumed
    from delta step 2 (base 1 + delta 2), steps 3-4 equal the uninterrupted run."""

    def job(load_step: int) -> dict:
        raw = _run(tmp_path, 1, 4, 2, load_step=load_step)
        raw["checkpoint"]["async_mode"] = "async"
        return raw

    whole = run_distributed(_nvme_train, 1, job(-1))
    resumed = run_distributed(_nvme_train, 1, job(2))
    for got, want in zip(resumed, whole, strict=True):
        assert _same(got["losses"], want["losses"][2:]), (got["losses"], want["losses"])
        for n, t in want["tables"].items():
            assert np.array_equal(got["tables"][n], t), n
