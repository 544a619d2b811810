"""The Engram tables in the report: their state per table optimizer (bytes from the optimizer's
spec, engram/config/table_optimizers.py), and the replicated-table baselines set beside the
row-sharded tables."""

from __future__ import annotations

from engram.config.table_optimizers import TABLE_OPTIMIZERS, table_memory_bytes
from planner.results import ADAM_STATES, RankMemory, ReplicatedTableBaseline


def table_memory_markdown(table_rows: dict[int, int], dim: int, world: int) -> list[str]:
    """Markdown lines for the memory estimator: the Engram tables' bytes per parameter and per
    rank (worst rank of the torch.chunk row split over `world` ranks) for each table optimizer."""
    if not table_rows or dim <= 0:
        return []
    rows = sum(-(-r // world) for r in table_rows.values())
    adam = sum(table_memory_bytes("adam", rows, dim).values())
    lines = [
        "",
        f"### Engram tables per rank by optimizer.table_optimizer (fp32, {world} ranks)",
        "",
        "| table_optimizer | B / table param | weight + grad + state per rank (GiB) | frees vs adam (GiB) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in TABLE_OPTIMIZERS:
        total = sum(table_memory_bytes(name, rows, dim).values())
        lines.append(
            f"| {name} | {total / (rows * dim):.3g} | {total / 1024**3:.2f} | "
            f"{(adam - total) / 1024**3:.2f} |"
        )
    return lines


def replicated_tables(
    results: list[RankMemory],
    table_rows: dict[int, int],
    n_tables: int,
    stage_world: int,
    fragmentation: float,
) -> ReplicatedTableBaseline:
    """The Engram table state of the worst reported rank if its stages' tables (all tables
    without PP) were replicated on every rank of its stage instead of row-sharded: the sharded
    table state leaves, the full one arrives; the rest scales with the allocator fragmentation
    the same way."""
    table_state = [m.table_param_bytes * (1 + 1 + ADAM_STATES) for m in results]
    worst = max(results, key=lambda m: m.peak_bytes)
    width = n_tables // sum(table_rows.values()) if table_rows else 0
    stage_tables = width * sum(table_rows[layer] for layer in worst.table_rows)
    full = 4 * stage_tables  # fp32 bytes
    ddp = full * (1 + 1 + ADAM_STATES)
    worst_table = worst.table_param_bytes * (1 + 1 + ADAM_STATES)
    return ReplicatedTableBaseline(
        table_params_total=stage_tables,
        ddp_bytes=ddp,
        zero1_bytes=2 * full + ADAM_STATES * full // stage_world,
        zero2_bytes=2 * full + (1 + ADAM_STATES) * full // stage_world,
        row_sharded_bytes_max=max(table_state),
        peak_with_ddp_tables_max=worst.peak_bytes + int((1 + fragmentation) * (ddp - worst_table)),
    )
