"""Make a checkpoint of recipes/train_deepspeed.py resumable at another world size.

    python scripts/deepspeed_universal.py <run folder>/checkpoint/step-<N> [--workers K]

then resume with the same launch command at the new number of ranks. It runs DeepSpeed's own
converter (deepspeed.checkpoint.ds_to_universal) in this one process on CPU (no accelerator,
no process group) into `step-<N>/engine/model_universal/` and lists the new files in the
step's manifest, so the resume verifies them like the rest of the checkpoint. The step folder is
verified first (a damaged one is refused). Disk: about the engine's fp32 weights and two Adam
moments again (12 bytes per dense parameter). The Engram tables need no conversion (DCP shards
reshard by themselves). Details: docs/deepspeed.md, "Checkpoints".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.deepspeed_engine import convert_to_universal, import_deepspeed  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step_dir", type=Path, help="a step-<N> folder of train_deepspeed.py")
    parser.add_argument(
        "--workers", type=int, default=1, help="DeepSpeed's extract / merge processes (default 1)"
    )
    args = parser.parse_args(argv)
    import_deepspeed("cpu")
    begin = time.perf_counter()
    out = convert_to_universal(args.step_dir, workers=args.workers)
    print(f"universal checkpoint: {out} ({time.perf_counter() - begin:.1f} s), in the manifest")


if __name__ == "__main__":
    main()
