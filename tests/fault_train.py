"""recipes/train.py with kill -9 fault injection, for tests/test_recipes_faults_restart.py.

    FAULTS="0:step:1:3,1:save:0:6" TRAIN_SCRIPT=tests/fault_train.py ./run_train.sh ...

Each entry is attempt:kind:rank:step. In torchrun attempt `attempt` (TORCHELASTIC_RESTART_COUNT),
rank `rank` SIGKILLs itself: kind "step" in the middle of optimizer step `step` (after backward,
before the update), kind "save" in the middle of saving step `step` (after DCP wrote the shards,
before the manifest). Kinds "write" and "nospace" (NVMe tables) arm ENGRAM_FAULTS
(engram/runtime/faults.py) when step `step` starts, which must follow a save or the resume: the
rank SIGKILLs itself ("write") or fails with ENOSPC ("nospace") at the second page its NVMe
stores write back from then on (an eviction batch's: this step's pin, or the next step's
page-in). That point is deterministic: the save settled every write-back in flight (the
checkpoint reads the rows through NvmeRowStore.read_range) and a resume's loads write
synchronously, so every write counted after the arming follows the host worker's program
order. (It was once a count read off an uninterrupted run at this step's clip: how far that
run's asynchronous page-in had got by then is timing, and under load the point moved.)
Rank 0 appends {attempt, complete steps before loading, start step} to $FAULT_LOG, so the test
can check that every try resumed from the newest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engram.checkpoint.manager as ckpt  # noqa: E402
import recipes.train as recipe  # noqa: E402
import runner.step as train_step  # noqa: E402  (the recipe's step: clip is called there)
from engram.runtime import faults  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))
FAULTS = [f.split(":") for f in os.environ.get("FAULTS", "").split(",") if f]
MINE = {(kind, int(step)) for a, kind, r, step in FAULTS if int(a) == ATTEMPT and int(r) == RANK}
state = {"step": 0}


WRITE_FAULTS = {"write": "kill", "nospace": "enospc"}  # kind -> ENGRAM_FAULTS action


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


real_load = ckpt.CheckpointManager.load


def load(self):
    before = self.complete_steps()
    start = real_load(self)
    state["step"] = start
    if RANK == 0:
        with open(os.environ["FAULT_LOG"], "a") as f:
            f.write(json.dumps({"attempt": ATTEMPT, "complete": before, "start": start}) + "\n")
    return start


real_clip = train_step.clip_grad_norm_


def clip(*args, **kwargs):
    state["step"] += 1
    norm = real_clip(*args, **kwargs)
    if ("step", state["step"]) in MINE:
        _die()
    return norm


real_dcp_save = ckpt.dcp.save


def dcp_save(state_dict, checkpoint_id=None, **kwargs):
    out = real_dcp_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
    where = checkpoint_id if checkpoint_id is not None else kwargs["storage_writer"].path
    step = int(Path(str(where)).name.removeprefix("step-").removesuffix(".tmp"))
    if ("save", step) in MINE:
        _die()
    return out


real_call = train_step.TrainStep.__call__


def call(self, batches, step, *args, **kwargs):
    for kind, action in WRITE_FAULTS.items():
        if (kind, step) in MINE:  # counts from here (faults.configure restarts them)
            faults.configure(f"nvme.page_write:2:{action}:{RANK}:{ATTEMPT}")
    return real_call(self, batches, step, *args, **kwargs)


ckpt.CheckpointManager.load = load
train_step.TrainStep.__call__ = call
train_step.clip_grad_norm_ = clip
ckpt.dcp.save = dcp_save

if __name__ == "__main__":
    recipe.main()
