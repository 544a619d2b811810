"""Activations a pipeline rank holds at its peak: count torch's own schedule order.

Every schedule of torch.distributed.pipelining is a list of actions per pp rank (F: forward of
one micro-batch on one stage, B: its full backward, I: backward to the stage input only, W: the
weight gradients after an I). A forward keeps the micro-batch's saved activations of that stage
until they are freed:

    F  +saved(stage)      the stage's activations of one micro-batch are saved
    B  -saved(stage)      full backward frees them
    I  +0                 torch's backward-to-input keeps the graph (retain_graph) for W
    W  -saved(stage)      weight gradients done: now they are freed

Walking a rank's actions in order gives the running sum; its maximum is the rank's peak of
saved activations, and the counts of un-freed forwards at that moment are the micro-batches in
flight per stage. For one stage per rank this reproduces the textbook numbers (tested):
GPipe holds all m micro-batches, 1F1B holds min(m, pp - r) on pp rank r (pp on rank 0),
zero-bubble schedules hold what 1F1B holds until W frees it. The order comes from the schedule
class itself (schedule_order below), so a schedule torch changes is counted as
torch runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _ComputationType,
    get_schedule_class,
)

from parallelisms.pipeline import stage_ranks


class _PlannedStage:
    """What a torch schedule reads from a stage to compute its action order, and nothing else
    (no module, no process group): lets the memory planner ask torch for the order of any
    layout without building one."""

    def __init__(self, stage_index: int, num_stages: int, pp: int, pp_rank: int) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = pp, pp_rank
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None


def schedule_order(name: str, pp: int, virtual_stages: int, microbatches: int) -> dict:
    """torch's own action order of schedule `name` (pp rank -> [_Action | None]): F / B (full
    backward) / I (input grads) / W (weight grads) per (stage, micro-batch), as the schedule
    class computes it at construction. Used by scripts/estimate_memory.py to count the
    micro-batches each stage holds in flight."""
    num_stages = pp * virtual_stages
    ranks = stage_ranks(num_stages, pp, name)
    stages = [_PlannedStage(s, num_stages, pp, 0) for s, r in enumerate(ranks) if r == 0]
    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        schedule = cls(stages[0], n_microbatches=microbatches, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=microbatches, scale_grads=False)
    return schedule.pipeline_order


_ADD = {_ComputationType.FORWARD}


_FREE = {_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_WEIGHT}


@dataclass
class InFlight:
    """Peak of saved activations on one pp rank over one schedule step."""

    peak_bytes: int
    """Largest running sum of saved activation bytes."""
    micro_batches: dict[int, int] = field(default_factory=dict)
    """Stage index -> micro-batches whose activations are held at that peak."""
    max_micro_batches: dict[int, int] = field(default_factory=dict)
    """Stage index -> most micro-batches it ever holds at once (may be at another moment)."""


def _compute_actions(actions) -> list:
    """Flatten OVERLAP_F_B (DualPipeV) into its forward and backward; drop idle slots."""
    out = []
    for a in actions:
        if a is None:
            continue
        out.extend(a.sub_actions or (a,))
    return out


def in_flight(
    schedule: str,
    pp: int,
    virtual_stages: int,
    microbatches: int,
    pp_rank: int,
    saved_per_stage: dict[int, int],
) -> InFlight:
    """Peak saved activations on `pp_rank`: `saved_per_stage[s]` is what one micro-batch of
    stage s saves from its forward to its backward (bytes)."""
    order = schedule_order(schedule, pp, virtual_stages, microbatches)[pp_rank]
    held = dict.fromkeys(saved_per_stage, 0)
    most = dict(held)
    running, best = 0, InFlight(0, dict(held), dict(held))
    for a in _compute_actions(order):
        s = a.stage_index
        if a.computation_type in _ADD:
            held[s] += 1
            running += saved_per_stage[s]
            most[s] = max(most[s], held[s])
            if running > best.peak_bytes:
                best = InFlight(running, dict(held))
        elif a.computation_type in _FREE:
            held[s] -= 1
            running -= saved_per_stage[s]
    best.max_micro_batches = most
    return best


def bubble_fraction(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> float:
    """Idle fraction of the ideal pipeline (forward = 1, backward = 2 units, no communication):
    the textbook formulas, for the docs and the --compare table.

    GPipe / 1F1B: (pp - 1) / (m + pp - 1); interleaved / looped with v stages per rank:
    (pp - 1) / (v m + pp - 1); zero-bubble and DualPipeV schedules fill the warm-up / cool-down
    with weight-gradient work: ~0 when m >= 2 pp (reported as 0)."""
    m, v = microbatches, virtual_stages
    if schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        return 0.0 if m >= 2 * pp else (pp - 1) / (v * m + pp - 1) / 3
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / (m + pp - 1)
    return (pp - 1) / (v * m + pp - 1)
