"""The training loop's running record: the checkpointed counters (TrainState), each step's loss
and gradient norm, and the metrics of a log step.

Host reads (.item(), device synchronisation) happen on log steps only, plus the guard's one
finiteness check per step (engram/train/nonfinite.py): a host sync every step would stall an
accelerator's queue. Per-step values stay on the device until the end of the run.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from engram.checkpoint import TrainState
from engram.config import JobConfig
from engram.data.loader import DataLoader
from engram.runtime import device as dev
from engram.train.metrics import MetricsLogger, is_log_step
from engram.train.telemetry import StepTelemetry
from engram.train.throughput import Throughput


@dataclass
class TrainResult:
    """What a run leaves behind in memory (tests and notebooks use it; files are the real record)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    eval_exact_match: dict[int, float] = field(default_factory=dict)
    model: torch.nn.Module | None = None
    model_parts: list[torch.nn.Module] = field(default_factory=list)  # this rank's stages under PP
    start_step: int = 0


class Progress:
    """Create it right before the loop (it resets the peak-memory counters and starts the first
    timing window); per step: `record`, then, after evaluation and the checkpoint, `end_step`."""

    def __init__(
        self,
        cfg: JobConfig,
        dp_size: int,
        state: TrainState,
        metrics: MetricsLogger,
        train_loader: DataLoader,
        device: torch.device,
        throughput: Throughput | None = None,
        telemetry: StepTelemetry | None = None,
    ) -> None:
        t = cfg.training
        self.cfg, self.dp_size, self.state = cfg, dp_size, state
        self.metrics, self.train_loader, self.device = metrics, train_loader, device
        self.throughput, self.telemetry = throughput, telemetry
        self.tokens_per_step = t.local_batch_size * t.seq_len * t.grad_accum_steps  # this rank's
        self.losses: list[torch.Tensor] = []  # the step's token mean per step, on the device
        self.grad_norms: list[torch.Tensor] = []
        dev.reset_peak_memory(device)
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.window_targets = torch.zeros((), dtype=torch.int64, device=device)

    def data_timer(self):
        """Around the step's wait for its batches (the data_time_s metric)."""
        return self.throughput.data_timer() if self.throughput else nullcontext()

    def is_log_step(self, step: int) -> bool:
        return is_log_step(self.cfg, step)

    def record(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: float,
        nonfinite: int,
        target_tokens: torch.Tensor,
    ) -> None:
        """Count the step; on a log step write its metrics (`lr`: the one its update used;
        `nonfinite`: the guard's count of skipped steps; `target_tokens`: the step's count of
        target tokens over every rank, the loss's divisor, on the device)."""
        self.state.step = step
        self.state.tokens_seen += self.tokens_per_step * self.dp_size
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.window_steps += 1
        self.window_targets += target_tokens
        if not self.is_log_step(step):
            return
        dev.synchronize(self.device)
        dt = (time.perf_counter() - self.window_start) / self.window_steps
        mem = dev.memory_stats(self.device)
        seq_len = self.cfg.training.seq_len
        tokens_per_s = self.tokens_per_step * self.dp_size / dt
        targets_per_s = self.window_targets.item() / self.window_steps / dt
        extra = (
            self.throughput.metrics(tokens_per_s, dt, self.window_steps) if self.throughput else {}
        )
        # Engram gates / tables and the table tiers (engram/train/telemetry.py): one collective
        telemetry = self.telemetry.metrics() if self.telemetry else {}
        self.metrics.log(
            step,
            {
                "loss": loss.item(),
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens_per_s": tokens_per_s,
                # the loss's divisor: tokens with a label (all of packed text, the answers of
                # a prompt-masked chat set), this step's and per second over the window
                "target_tokens": int(target_tokens.item()),
                "target_tokens_per_s": targets_per_s,
                "step_time_s": dt,  # mean over the steps since the last log
                "tokens_seen": self.state.tokens_seen,
                "nonfinite_steps": nonfinite,
                **{f"mem_{k}": v for k, v in mem.items()},
                # data: global tokens consumed per mixture source (tokens dataset)
                **{
                    f"data_tokens/{name}": n * seq_len
                    for name, n in self.train_loader.samples_per_source().items()
                },
                **extra,  # tflops, mfu, device memory, data time (engram/train/throughput.py)
                **telemetry,
            },
        )

    def end_step(self, step: int) -> None:
        """After a log step's evaluation and checkpoint: the next timing window starts (their
        time is in no window)."""
        if self.is_log_step(step):
            self.window_start, self.window_steps = time.perf_counter(), 0
            self.window_targets.zero_()

    def history(self) -> tuple[list[float], list[float]]:
        """Every step's (loss, grad norm) of this run, read from the device once."""
        if not self.losses:
            return [], []
        return torch.stack(self.losses).tolist(), torch.stack(self.grad_norms).tolist()
