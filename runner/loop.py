"""What runs around the loop both recipes write out (recipes/train.py, recipes/train_deepspeed.py):

    run = TrainRun(cfg, proc, checkpointer, state, flops, start_step)  # after the load
    ...                                                       # the step, built with run.guard
    with run.start(train_step, train_loader, make_eval_loader):
        for step in range(start_step + 1, cfg.training.steps + 1):
            batches, ahead = run.batches(step)  # this step's micro-batches and the next step's
            out = train_step(batches, step, ahead)
            run.end_step(step, out)             # record, evaluate, save, end the step
    return run.finish(result)                   # the last host work, the history, the guard

Per step, in order:

    data         this step's micro-batches (read during the previous step) and the next step's,
                 read ahead so NVMe tables page their rows in while this step runs (timed: the
                 log's data time, one step's batches per step); the checkpointed loader state
                 stays that of the batches completed steps consumed (DataLoader.hold)
    the step     CP cut, host-table prefetch, forward / backward per micro-batch (the PP schedule
                 under PP), clip, the non-finite guard, the update (runner/step.py TrainStep, or
                 runner/engine_step.py EngineStep under DeepSpeed)
    end_step     the profiler's step; record (loss: the step's token mean, gradient norm,
                 learning rate, target tokens; on log steps throughput and memory:
                 engram/train/progress.py); evaluate every data.eval_every steps and at the last
                 (the held-out loss through the step's cut and loss; with data.eval_exact_match
                 the exact match of greedy answers to held-out questions, runner/exact_match.py);
                 save
                 at the checkpoint manager's interval, never at a skipped step; then the next
                 timing window starts, and after the first step the process groups get their
                 training timeout (start-up is over)

A recipe's own additions go in its loop: a metric (`run.metrics.log(step, {...})`: a line of its
own in metrics.jsonl and TensorBoard), another evaluation cadence (`run.evaluate(step)`), an
early stop (`break`: `run.finish` still runs after the `with`), a hook after the update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from engram.checkpoint import CheckpointManager, TrainState
from engram.config import JobConfig
from engram.data.loader import DataLoader
from engram.inference.export_run import export_at_end
from engram.rowstore.host_worker import wait_host_work
from engram.runtime.distributed import destroy_distributed, set_pg_timeouts
from engram.train.build import Process
from engram.train.evaluate import eval_batches, eval_due
from engram.train.flops import FlopCount
from engram.train.metrics import MetricsLogger
from engram.train.nonfinite import NonFiniteGuard
from engram.train.profiling import maybe_profile
from engram.train.progress import Progress, TrainResult
from engram.train.step import next_batches
from engram.train.throughput import Throughput
from runner.exact_match import ExactMatchEval
from runner.step import Batch, StepResult, TrainStep


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


class TrainRun:
    """A run's record and the pieces around its loop (the module docstring). Build it right
    after the checkpoint's load: it opens the metrics (metrics.jsonl, TensorBoard, the config
    record: only now, so a refused resume leaves the run folder's record untouched) and the
    non-finite guard (its errors name the last good checkpoint). Then `with run.start(step,
    ...):` around the loop over steps start_step + 1 .. training.steps."""

    def __init__(
        self,
        cfg: JobConfig,
        proc: Process,
        checkpointer: CheckpointManager,
        state: TrainState,
        flops: FlopCount,
        start_step: int,
    ) -> None:
        self.cfg, self.proc, self.checkpointer = cfg, proc, checkpointer
        self.state, self.flops, self.start_step = state, flops, start_step
        self.metrics = MetricsLogger(cfg.run_folder, cfg.metrics, proc.rank, cfg.to_dict())
        last_good = checkpointer.last_good_checkpoint
        self.guard = NonFiniteGuard(cfg.training.max_nonfinite_steps, last_good)
        self.eval_losses: dict[int, float] = {}
        self.eval_exact_match: dict[int, float] = {}
        self.last_step = start_step  # the last step ended (an early stop ends before the config's)

    @contextmanager
    def start(
        self,
        train_step: TrainStep,
        loader: DataLoader,
        make_eval_loader: Callable[[], Iterable],
        exact_match: ExactMatchEval | None = None,
    ) -> Iterator[TrainRun]:
        """Around the loop: the data read ahead, the progress record (its peak-memory counters
        reset, its first timing window started), one loss context (TP loss parallel) around
        every forward path (train, pipeline, eval), and the profiler. `exact_match`: the
        evaluation's greedy answers (runner/exact_match.py build_exact_match; None: not asked)."""
        cfg, proc, device = self.cfg, self.proc, self.proc.device
        self.train_step, self.make_eval_loader = train_step, make_eval_loader
        self.exact_match = exact_match
        self.data = ReadAhead(loader, cfg.training.grad_accum_steps, device, cfg.training.steps)
        profile = maybe_profile(
            cfg.profiling, cfg.run_folder, proc.rank, proc.device_type, self.start_step
        )
        throughput = Throughput(self.flops, device, proc.world_size, cfg.metrics.peak_tflops)
        dp_size = train_step.dims.dp_size
        self.progress = Progress(
            cfg, dp_size, self.state, self.metrics, loader, device, throughput,
            telemetry=train_step.telemetry,
        )  # fmt: skip
        with train_step.loss_fn.context(), profile as self.profiler:
            yield self

    def batches(self, step: int) -> tuple[list[Batch], list[Batch] | None]:
        """This step's micro-batches and the next step's (None at the last step), timed."""
        with self.progress.data_timer():
            return self.data.take(step)

    def end_step(self, step: int, out: StepResult) -> None:
        """After the step: record, evaluate, save, end the step (the module docstring)."""
        self.profiler.step()
        self.progress.record(
            step, out.loss, out.grad_norm, out.lr, self.guard.total, out.target_tokens
        )
        if eval_due(self.cfg, step):
            self.evaluate(step)
        self.save(step, out)
        self.progress.end_step(step)
        if step == self.start_step + 1:  # start-up is over (load, compile, first step): [comm]
            set_pg_timeouts(self.cfg.comm.train_timeout_s)
        self.last_step = step

    def evaluate(self, step: int) -> float | None:
        """The held-out evaluation now, logged at `step`: the loss of data.eval_batches batches
        (eval_loss; returned, None without eval batches) and, with data.eval_exact_match, the
        exact match of greedy answers to held-out questions (eval_exact_match, eval_questions)."""
        loss = None
        if self.cfg.data.eval_batches > 0:
            loader, n = self.make_eval_loader(), eval_batches(self.cfg)
            loss = self.train_step.evaluate(loader, n, self.proc.device)
            self.eval_losses[step] = loss
            self.metrics.log(step, {"eval_loss": loss})
        if self.exact_match is not None:
            em = self.exact_match(self.train_step.model_parts, self.train_step.dp_group)
            self.eval_exact_match[step] = em.score
            self.metrics.log(step, {"eval_exact_match": em.score, "eval_questions": em.total})
        return loss

    def save(self, step: int, out: StepResult) -> bool:
        """A checkpoint at the manager's interval and at the last step; True if one was saved."""
        # Never at a skipped step: a save there could prune the last good checkpoint.
        last_step = step == self.cfg.training.steps
        return self.checkpointer.maybe_save(step, last_step=last_step, finite=not out.skip)

    def finish(self, result: TrainResult) -> TrainResult:
        """After the loop: the last host-table update, `result`'s losses, grad norms and eval
        losses filled in, the metrics files closed; the guard raises if the run ended on
        non-finite steps."""
        wait_host_work()
        result.losses, result.grad_norms = self.progress.history()
        result.eval_losses.update(self.eval_losses)
        result.eval_exact_match.update(self.eval_exact_match)
        self.metrics.close()
        self.guard.check_finished(self.last_step)
        return result


def run_recipe(train: Callable[[JobConfig], TrainResult], cfg: JobConfig) -> None:
    """A recipe's main: train, then tear the process groups down (also after an error); then,
    with export.folder set, rank 0 exports the last checkpoint in one process
    (engram/inference/export_run.py, as scripts/export_hf.py) while the other ranks exit."""
    try:
        train(cfg)
        # Every rank leaves the last collective before any rank tears its process groups down.
        dist.barrier()
        rank = dist.get_rank()
    finally:
        destroy_distributed()
    if cfg.export.folder and rank == 0:
        export_at_end(cfg)
