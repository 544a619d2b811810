"""The recipe's teardown frees FSDP state and process groups before interpreter shutdown.

FSDP parameter groups hold the C++ process groups and sit in reference cycles; when they were
left for the interpreter's shutdown, gloo's teardown there aborted about 1 in 20 two-node runs
(test_runtime_multinode.py). `destroy_distributed` collects them while the interpreter is alive.
"""

from __future__ import annotations

import gc
from pathlib import Path

from launcher import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _train_then_destroy(rank: int, world: int, dump: str) -> tuple[int, int]:
    import torch.nn as nn
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from engram.config import load_config
    from engram.runtime.distributed import destroy_distributed
    from recipes.train import train

    cfg = load_config(
        [
            "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"),
            "--training.steps=2", f"--job.dump_folder={dump}", "--job.device=cpu",
            "--training.local_batch_size=2", "--training.seq_len=32", "--data.eval_batches=0",
            "--metrics.enable_tensorboard=false", "--checkpoint.enable=false",
        ]
    )  # fmt: skip
    # Count what train() leaves behind, not what the forking process already held (a module
    # another test keeps in a cache is inherited by the fork and is no leak of the recipe's).
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, (FSDPParamGroup, nn.Module))}
    train(cfg)  # the result (model, optimizers) is dropped, as in recipes/train.py main()
    destroy_distributed()
    alive = [o for o in gc.get_objects() if id(o) not in before]
    return (
        sum(isinstance(o, FSDPParamGroup) for o in alive),
        sum(isinstance(o, nn.Module) for o in alive),
    )


def test_destroy_distributed_frees_fsdp_state(tmp_path: Path) -> None:
    # fresh ranks: a pooled rank may hold objects of its earlier calls until they are collected
    results = run_distributed(_train_then_destroy, 2, str(tmp_path), fresh=True)
    assert results == [(0, 0), (0, 0)], (
        "FSDP parameter groups / modules outlive destroy_distributed: their process groups "
        f"would be torn down during interpreter shutdown (per rank: {results})"
    )
