"""Writing a DeepSpeed engine's checkpoint into a step folder: bounded in time, no helper scripts.

- DeepSpeed's `save_checkpoint` runs collectives of its own (gathers, barriers). A rank that
  fails inside it (a full disk, a bad path) raises, while the others wait in the next collective
  for as long as the backend lets them (hccl's timeouts cannot even be changed after creation):
  a hang that names nothing. A watchdog bounds it: past `timeout_s` the waiting rank logs what it
  waited for and exits, so the launcher stops the job and the failing rank's error is the one to
  read. A collective that times out first is reported the same way.
- DeepSpeed copies `zero_to_fp32.py` and `zero_to_torch.py` into every engine folder. Run by
  hand, they torch.load the step's files with `weights_only` off (a crafted file would run its
  code). They are removed before the step is committed; this repo's readers are
  scripts/export_hf.py (the weights, read weights-only) and scripts/deepspeed_universal.py (the
  universal format, another world size): docs/deepspeed.md.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from engram.checkpoint import CheckpointError

logger = logging.getLogger("engram")
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed 0.19's copies
WATCHDOG_EXIT_CODE = 3


def _expired(folder: Path, timeout_s: float) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (
        f"rank {rank}: DeepSpeed's save_checkpoint into {folder} did not finish within "
        f"{timeout_s:g} s (comm.train_timeout_s): another rank most likely failed inside "
        "DeepSpeed's save collectives, and its error (above, or in its log) is the cause. "
        "The checkpoint was not committed; the previous ones are intact"
    )


def save_bounded(save: Callable[[], None], folder: Path, timeout_s: float) -> None:
    """Run `save` (DeepSpeed's save_checkpoint into `folder`); past `timeout_s` exit this
    process, naming the cause (the watchdog), and turn a collective's own timeout into a
    CheckpointError that names it too. Then remove DeepSpeed's recovery scripts."""
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout_s):
            msg = _expired(folder, timeout_s)
            logger.error(msg)
            print(msg, file=sys.stderr, flush=True)
            os._exit(WATCHDOG_EXIT_CODE)  # the main thread is stuck inside a collective

    threading.Thread(target=watchdog, name="deepspeed-save-watchdog", daemon=True).start()
    try:
        save()
    except RuntimeError as e:
        if "timed out" in str(e).lower():
            raise CheckpointError(f"{_expired(folder, timeout_s)} ({e})") from e
        raise
    finally:
        done.set()
    for script in RECOVERY_SCRIPTS:
        (folder / script).unlink(missing_ok=True)
