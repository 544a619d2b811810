"""Skip optimizer steps whose loss or gradient norm is not finite; stop after too many in a row.

Called once per step from the training loop, after the gradient norm and before any optimizer
update (torchtitan does the same). The input must be global values (the dp-summed loss, the
all-reduced grad norm), so every rank takes the same decision without another collective. The
check is the one host read of a training step that is not a log step (`skip` needs a Python
bool); the values themselves are read only when they are not finite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("engram")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm, or the run ended
    inside such a streak."""


class NonFiniteGuard:
    """Counts non-finite steps; `skip(...)` says whether this step's update must be skipped.

    `last_good` returns the newest intact checkpoint saved at a finite step (for the error
    message), or None."""

    def __init__(self, max_in_a_row: int, last_good: Callable[[], Path | None] = lambda: None):
        self.max_in_a_row = max_in_a_row
        self.last_good = last_good
        self.in_a_row = 0
        self.total = 0

    def skip(self, step: int, loss_and_grad_norm: torch.Tensor) -> bool:
        """`loss_and_grad_norm`: the step's global loss and gradient norm, one tensor (one host
        read decides)."""
        if bool(torch.isfinite(loss_and_grad_norm).all()):
            self.in_a_row = 0
            return False
        loss, grad_norm = loss_and_grad_norm.tolist()
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
            raise NonFiniteError(
                f"{self.in_a_row} consecutive steps (up to step {step}) had a non-finite loss or "
                f"gradient norm. {self._resume_hint()}"
            )
        return True

    def check_finished(self, step: int) -> None:
        """At the end of the run: an error if its last steps were skipped (their updates are
        lost and no checkpoint was saved at them)."""
        if self.in_a_row:
            raise NonFiniteError(
                f"the run ended with {self.in_a_row} non-finite step(s) in a row (up to step "
                f"{step}): their updates were skipped and no checkpoint was saved at them. "
                f"{self._resume_hint()}"
            )

    def _resume_hint(self) -> str:
        good = self.last_good()
        where = f"The last good checkpoint is {good}" if good else "There is no good checkpoint"
        return (
            f"{where}: resume from it with a lower optimizer.lr, a clipping norm "
            "(training.max_norm), or check the data"
        )
