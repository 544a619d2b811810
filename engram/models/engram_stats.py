"""What the Engram blocks report on log steps: a side channel of statistics, off by default.

An Engram block stays a pure function of (hidden_states, hash_ids): it keeps nothing between
calls and its output never depends on this channel. While a collector is open
(`recording(stats)`, engram/train/telemetry.py opens one around the forward / backward of a log
step only), each block's forward adds its sums to the collector's one device tensor:

    gate_sum, gate_high   sum of the gate values, number of positions with gate > 0.5
    gate_entropy          sum of the gates' binary entropy (nats)
    positions             number of gate values (positions x hc_mult branches)
    out_sq, residual_sq   sum of squares of the block's output and of its input (the residual)

so a log step reads the gate mean, the share of open gates and the output / residual RMS ratio
as ratios of sums: no host read here, and the sums of every rank add up (each rank's own tokens;
a recompute that adds them twice changes no ratio).

Off (every step but log steps) the forward runs exactly as without this module: `sink()` is a
read of one module-level slot, None, and torch.compile guards on it, so a compiled block has no
graph break there. On a log step the collector's `add` runs eagerly (`torch.compiler.disable`:
one graph break per block on that step only) and skips the recompute of activation
checkpointing, which runs the forward again inside backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["FIELDS", "EngramStats", "paused", "recording", "sink"]

FIELDS = ("gate_sum", "gate_high", "gate_entropy", "positions", "out_sq", "residual_sq")

_SINK: list[EngramStats | None] = [None]


class EngramStats:
    """Per-layer sums of FIELDS on the device: one row per Engram layer id of the model (a
    rank's pipeline stage fills only its own rows)."""

    def __init__(self, layer_ids: list[int], device: torch.device) -> None:
        self.layer_ids = list(layer_ids)
        self._row = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.sums = torch.zeros(len(self.layer_ids), len(FIELDS), dtype=torch.float32,
                                device=device)  # fmt: skip

    def reset(self) -> None:
        self.sums.zero_()

    @torch.compiler.disable
    def add(
        self, layer_id: int, gate: torch.Tensor, out: torch.Tensor, residual: torch.Tensor
    ) -> None:
        """Add one forward of layer `layer_id`: its gates [B, T, hc, 1], output and input."""
        if torch._C._current_graph_task_id() != -1:  # an activation-checkpoint recompute
            return
        with torch.no_grad():
            g = gate.detach().float()
            p = g.clamp(1e-6, 1 - 1e-6)
            entropy = -(p * p.log() + (1 - p) * (1 - p).log())
            values = torch.stack([
                g.sum(), (g > 0.5).sum().float(), entropy.sum(),
                g.new_full((), float(g.numel())),
                out.detach().float().pow(2).sum(), residual.detach().float().pow(2).sum(),
            ])  # fmt: skip
            self.sums[self._row[layer_id]] += values


def sink() -> EngramStats | None:
    """The open collector, or None (every step but log steps)."""
    return _SINK[0]


@contextmanager
def recording(stats: EngramStats) -> Iterator[EngramStats]:
    """Engram blocks add their sums to `stats` inside (not reentrant)."""
    if _SINK[0] is not None:
        raise RuntimeError("Engram statistics are already being recorded")
    _SINK[0] = stats
    try:
        yield stats
    finally:
        _SINK[0] = None


@contextmanager
def paused() -> Iterator[None]:
    """No block records inside: for forwards that are not the step's (torch's pipeline stages
    run one on micro-batch 0, with made-up inputs, to infer the shapes they send)."""
    saved, _SINK[0] = _SINK[0], None
    try:
        yield
    finally:
        _SINK[0] = saved
