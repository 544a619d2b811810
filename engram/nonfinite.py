"""Skip optimizer steps whose loss or gradient norm is not finite; stop after too many in a row.

Called once per step from the training loop, after the gradient norm and before any optimizer
update (torchtitan does the same). Both inputs must be global values (the dp-mean loss, the
all-reduced grad norm), so every rank takes the same decision without another collective.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("engram")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


class NonFiniteGuard:
    """Counts non-finite steps; `skip(...)` says whether this step's update must be skipped.

    `last_good` returns the newest intact checkpoint (for the error message), or None."""

    def __init__(self, max_in_a_row: int, last_good: Callable[[], Path | None] = lambda: None):
        self.max_in_a_row = max_in_a_row
        self.last_good = last_good
        self.in_a_row = 0
        self.total = 0

    def skip(self, step: int, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.total += 1
        logger.warning(
            "step %d: non-finite loss %s / grad norm %s: optimizer update skipped (%d in a row, "
            "%d in total; the run stops after training.max_nonfinite_steps = %d in a row)",
            step,
            loss,
            grad_norm,
            self.in_a_row,
            self.total,
            self.max_in_a_row,
        )
        if self.in_a_row >= self.max_in_a_row:
            good = self.last_good()
            raise NonFiniteError(
                f"{self.in_a_row} consecutive steps (up to step {step}) had a non-finite loss or "
                f"gradient norm. The last good checkpoint is {good or 'none (none saved)'}: "
                "resume from it with a lower optimizer.lr, a clipping norm (training.max_norm), "
                "or check the data"
            )
        return True
