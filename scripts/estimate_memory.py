"""Per-rank device memory of a real config at its real world size, without the hardware.

    python scripts/estimate_memory.py --job.config_file train_configs/32b_npu.toml --world_size 64 \
        [--ranks 0,1,32,63 | --ranks all] [--device h200 | --device_memory_gib 64] [--json] \
        [--section.key=value ...]

One process plays each requested rank in turn: torch's fake process group (collectives are no-ops)
at the real world size, the model built on the meta device (nothing is allocated) and wrapped by
recipes/train.py's own `parallelisms.parallelize.parallelize_model` (the one statement of the
order of float8, table sharding, activation checkpointing, compile and FSDP2). Parameter,
gradient and optimizer-state bytes are then EXACT:
they are read from the local shapes of the sharded DTensors. FSDP buffers (all-gather,
reduce-scatter, gradient accumulation) are computed from the exact unit shapes with FSDP2's
padding; activations, allocator fragmentation and runtime/collective buffers are ESTIMATES
(formulas and assumptions stated next to each number; see docs/memory_estimate.md).

Modelled: FSDP2 / HSDP / DDP, activation checkpointing, CPU offload, float8 (torchao keeps the
weights in high precision and casts them per layer: only transient float8 copies are added),
tensor parallelism (parameter bytes from the sharded DTensors; activations divided by tp under
sequence parallel, see activation_estimate), pipeline parallelism (each rank builds its own
stages with parallelisms.pipeline.split_stages, exactly as the recipe; FSDP keeps a stage's
parameters and unsharded gradients across its micro-batches; saved activations are counted
micro-batch by micro-batch along torch's own schedule order, planner/schedule.py), context
parallelism (FSDP over dp_shard x cp and tables over dp x cp x tp from the built ranks;
activations / cp with the keys and values each method holds, all-gather K/V's masks, the
all-to-all / all-gather bytes per layer). Compile is estimated as eager (inductor usually saves
activation memory, never adds much). Calibrated against peaks measured on an H200
(docs/memory_estimate.md, "Calibration on an H200"; tests/test_planner_calibration.py).

`--compare` prints candidate layouts side by side instead (planner/compare.py): peak per rank,
communication per step and a fit verdict (`--cp 2,4,8 --cp_methods ulysses,allgather_kv` adds
context-parallel candidates).

The planner itself is the `planner/` package (docs/memory_estimate.md); this file is its command
line.
"""

import sys
from pathlib import Path

# The script runs from its checkout (python scripts/estimate_memory.py), not an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
