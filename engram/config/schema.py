"""The typed job configuration: `JobConfig`, one dataclass per TOML section (the sections live in
model.py, training.py and parallelism.py, every field documented and checked in `__post_init__`),
plus the checks that span sections. Reading TOML and overrides: engram/config/loading.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engram.config.checks import check
from engram.config.model import Engram, Lora, Model
from engram.config.parallelism import (
    ActivationCheckpoint,
    Comm,
    Compile,
    DeepSpeed,
    Float8,
    Parallelism,
    Pipeline,
)
from engram.config.table_locations import table_location_error
from engram.config.training import (
    Checkpoint,
    Data,
    Export,
    Job,
    LRScheduler,
    Metrics,
    Optimizer,
    Profiling,
    Training,
)


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    engram: Engram = field(default_factory=Engram)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    export: Export = field(default_factory=Export)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    pipeline: Pipeline = field(default_factory=Pipeline)
    float8: Float8 = field(default_factory=Float8)
    compile: Compile = field(default_factory=Compile)
    deepspeed: DeepSpeed = field(default_factory=DeepSpeed)
    lora: Lora = field(default_factory=Lora)
    comm: Comm = field(default_factory=Comm)

    def __post_init__(self) -> None:
        # job.device = "auto" is checked once it resolves (engram/train/build.py init_process)
        if self.job.device != "auto":
            self.compile.check_device(self.job.device)
        location_error = table_location_error(
            self.engram.table_location, self.optimizer.table_optimizer
        )
        check(not (self.engram.enabled and location_error), location_error or "")
        check(
            not (
                self.model.attn_mask_type == "block_causal"
                and self.engram.enabled
                and not self.engram.respect_doc_boundaries
            ),
            "model.attn_mask_type = 'block_causal' keeps packed documents apart, but Engram "
            "n-grams would still reach across them: set engram.respect_doc_boundaries = true",
        )
        check(
            not (self.model.attn_backend == "flex" and self.job.device == "npu"),
            "model.attn_backend = 'flex': FlexAttention is not available on NPU; set "
            "model.attn_backend = 'sdpa'",
        )
        check(
            not (self.export.folder and not self.checkpoint.enable),
            "export.folder exports the run's last checkpoint: set checkpoint.enable = true",
        )
        check(
            not (self.export.lora != "peft" and self.training.mode != "lora"),
            f"export.lora = {self.export.lora!r} chooses the folder of LoRA adapters, but "
            f"training.mode = {self.training.mode!r}: remove it",
        )
        self._check_exact_match()

    def _check_exact_match(self) -> None:
        """The training loop's exact match decodes every rank's whole model (engram/inference/qa.py)."""
        if not self.data.eval_exact_match:
            return
        p = self.parallelism
        split = [name for name in ("tp", "pp", "cp") if getattr(p, name) > 1]
        check(
            not split,
            f"data.eval_exact_match decodes with each rank's whole model (FSDP / HSDP / DDP), but "
            f"parallelism.{split[0] if split else ''} > 1 splits it: set data.eval_exact_match = 0 "
            "and run scripts/eval_qa.py on the checkpoint (one process)",
        )
        check(
            not (self.engram.enabled and self.engram.table_location != "device"),
            "data.eval_exact_match decodes token by token, but "
            f"engram.table_location = {self.engram.table_location!r} tables are prefetched per "
            "training step only: set data.eval_exact_match = 0 and run scripts/eval_qa.py on the "
            "checkpoint",
        )

    def at_dp(self, dp: int) -> JobConfig:
        """This config at `dp` data-parallel ranks (training.global_batch_size turned into
        grad_accum_steps: Training.at_dp). The recipes and the planner call it once the world
        is known."""
        return dataclasses.replace(self, training=self.training.at_dp(dp))

    @property
    def run_folder(self) -> Path:
        return Path(self.job.dump_folder) / self.job.run_name

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)
