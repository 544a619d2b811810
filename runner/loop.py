"""The training loop both recipes run around their step (runner/step.py TrainStep, or
runner/engine_step.py EngineStep under DeepSpeed). Per step, in order:

    data         this step's micro-batches (read during the previous step) and the next step's,
                 read ahead so NVMe tables page their rows in while this step runs (timed: the
                 log's data time, one step's batches per step); the checkpointed loader state
                 stays that of the batches completed steps consumed (DataLoader.hold)
    the step     CP cut, host-table prefetch, forward / backward per micro-batch (the PP schedule
                 under PP), clip, the non-finite guard, the update (TrainStep)
    log          loss, gradient norm, learning rate; on log steps throughput and memory
    evaluate     every data.eval_every steps and at the last (through the step's cut and loss)
    save         the checkpoint manager's interval; never at a skipped step

and after the first step the process groups get their training timeout (start-up is over).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.distributed as dist

from engram.checkpoint import CheckpointManager, TrainState
from engram.config import JobConfig
from engram.data.loader import DataLoader
from engram.rowstore.host_worker import wait_host_work
from engram.runtime.distributed import destroy_distributed, set_pg_timeouts
from engram.train.build import Process
from engram.train.evaluate import eval_due
from engram.train.flops import FlopCount
from engram.train.metrics import MetricsLogger
from engram.train.nonfinite import NonFiniteGuard
from engram.train.profiling import maybe_profile
from engram.train.progress import Progress, TrainResult
from engram.train.step import next_batches
from engram.train.throughput import Throughput
from runner.step import Batch, TrainStep


@dataclass
class RunParts:
    """What the loop needs of a run besides its step (built by the recipe, in its order)."""

    proc: Process
    dp_size: int
    flops: FlopCount
    state: TrainState
    metrics: MetricsLogger
    train_loader: DataLoader
    make_eval_loader: Callable[[], Iterable]
    checkpointer: CheckpointManager
    guard: NonFiniteGuard
    result: TrainResult


class ReadAhead:
    """Each step's micro-batches with the next step's, read one step ahead. While the next
    step's are held the loader's state is held at the batches handed out for steps so far, so a
    checkpoint saved after a step resumes exactly where an uninterrupted run goes on."""

    def __init__(self, loader: DataLoader, n: int, device, last_step: int) -> None:
        self.loader, self.n, self.device, self.last_step = loader, n, device, last_step
        self.data_iter = iter(loader)
        self.next: list[Batch] | None = None

    def take(self, step: int) -> tuple[list[Batch], list[Batch] | None]:
        """(step `step`'s batches, step + 1's or None at the last step)."""
        self.loader.release()  # the batches held ahead are this step's now
        batches = self.next or next_batches(self.data_iter, self.n, self.device)
        self.next = None
        if step < self.last_step:
            self.loader.hold()
            self.next = next_batches(self.data_iter, self.n, self.device)
        return batches, self.next


def train_loop(cfg: JobConfig, run: RunParts, train_step: TrainStep) -> TrainResult:
    """Steps result.start_step + 1 .. training.steps; returns the result with its losses and
    grad norms filled in (the guard raises if the run ended on too many non-finite steps)."""
    proc, device, start_step = run.proc, run.proc.device, run.result.start_step
    data = ReadAhead(run.train_loader, cfg.training.grad_accum_steps, device, cfg.training.steps)
    profile = maybe_profile(cfg.profiling, cfg.run_folder, proc.rank, proc.device_type, start_step)
    throughput = Throughput(run.flops, device, proc.world_size, cfg.metrics.peak_tflops)
    progress = Progress(
        cfg, run.dp_size, run.state, run.metrics, run.train_loader, device, throughput,
        telemetry=train_step.telemetry,
    )  # fmt: skip
    # One loss context (TP loss parallel) around every forward path: train, pipeline, eval.
    with train_step.loss_fn.context(), profile as profiler:
        for step in range(start_step + 1, cfg.training.steps + 1):
            with progress.data_timer():
                batches, ahead = data.take(step)
            out = train_step(batches, step, ahead)
            profiler.step()
            progress.record(step, out.loss, out.grad_norm, out.lr, run.guard.total)
            if eval_due(cfg, step):
                loss = train_step.evaluate(run.make_eval_loader(), cfg.data.eval_batches, device)
                run.result.eval_losses[step] = loss
                run.metrics.log(step, {"eval_loss": loss})
            # Never at a skipped step: a save there could prune the last good checkpoint.
            last_step = step == cfg.training.steps
            run.checkpointer.maybe_save(step, last_step=last_step, finite=not out.skip)
            progress.end_step(step)
            if step == start_step + 1:  # start-up is over (load, compile, first step): [comm]
                set_pg_timeouts(cfg.comm.train_timeout_s)
    wait_host_work()  # the last host-table update
    run.result.losses, run.result.grad_norms = progress.history()
    run.metrics.close()
    run.guard.check_finished(cfg.training.steps)
    return run.result


def run_recipe(train: Callable[[JobConfig], TrainResult], cfg: JobConfig) -> None:
    """A recipe's main: train, then tear the process groups down (also after an error)."""
    try:
        train(cfg)
        # Every rank leaves the last collective before any rank tears its process groups down.
        dist.barrier()
    finally:
        destroy_distributed()
