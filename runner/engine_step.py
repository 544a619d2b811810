"""The one training step (runner/step.py) under a DeepSpeed engine: recipes/train_deepspeed.py.

The order (the step's target-token count, micro-batches, clip, logged loss, guard, update,
schedules) is TrainStep's; the engine replaces three parts: `engine.backward` per micro-batch
(between accumulation boundaries `engine.step()` only counts the micro-batch), one global
gradient norm over the engine and the Engram tables (DeepSpeed's own clipping is off), and
`engine.step()` with the tables' step. No context-parallel cut and no pipeline:
runner/deepspeed_engine.py check_layout refuses them.

The loss is TrainStep's (each micro-batch's token sum / the step's one count of target tokens,
engram/train/loss.py), whose gradients must be summed over micro-batches and dp ranks. The
engine divides them instead, by gradient_accumulation_steps (unless `scale_wrt_gas=False`) and
by the dp size (its gradient mean), so the backward gets the loss times dp with
`scale_wrt_gas=False`; the Engram tables, outside the engine, see that factor too and take it
back with their grad_scale 1 / dp (runner/deepspeed_engine.py place_for_engine).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from engram.config import JobConfig
from engram.train.loss import LanguageModelLoss, TargetTokens
from engram.train.nonfinite import NonFiniteGuard
from engram.train.step import model_inputs, step_optimizers
from parallelisms.parallel_dims import ParallelDims
from runner.deepspeed_engine import clip_engine_and_tables_, engine_update_discarded
from runner.step import Batch, TrainStep


class EngineStep(TrainStep):
    """TrainStep with the DeepSpeed engine's forward / backward, clip and update. The optimizers
    are the tables' own (the engine holds the dense one); `schedulers` cover both."""

    prefetches_tables = False  # host / NVMe tables are refused here (deepspeed_settings.py)

    def __init__(
        self,
        cfg: JobConfig,
        dims: ParallelDims,
        engine: Any,
        table_params: list[torch.nn.Parameter],
        table_optimizers: list[torch.optim.Optimizer],
        schedulers: list[LambdaLR],
        guard: NonFiniteGuard,
        dp_group: dist.ProcessGroup,
    ) -> None:
        # The training and evaluation loss, on the full logits (no TP here).
        loss_fn = LanguageModelLoss(1, None, sharded_logits=False)
        super().__init__(
            cfg, dims, [engine], loss_fn, table_optimizers, schedulers, guard=guard,
            dp_group=dp_group,
        )  # fmt: skip
        self.engine = engine
        self.table_params = table_params

    def cut(self, batch: Batch) -> Batch:
        return batch  # cp = 1 (check_layout)

    def forward_backward(self, batches: list[Batch], tokens: TargetTokens) -> torch.Tensor:
        engine = self.engine
        undo_mean = float(self.dims.dp_size)  # the engine averages its gradients over dp
        loss_share = torch.zeros((), device=batches[0]["labels"].device)
        for micro, batch in enumerate(batches):
            logits = engine(batch["input_ids"], **model_inputs(batch))
            loss = self.loss_fn(logits, batch["labels"], tokens.divisor)
            # gradients reduced at the last micro-batch; no division by accumulation steps
            engine.backward(loss * undo_mean, scale_wrt_gas=False)
            loss_share += loss.detach()
            if micro < len(batches) - 1:
                engine.step()  # between boundaries DeepSpeed only counts the micro-batch
        return loss_share

    def clip(self) -> torch.Tensor:
        return clip_engine_and_tables_(self.engine, self.table_params, self.cfg.training.max_norm)

    def update(self, skip: bool) -> None:
        # A skipped step skips the engine too, also when only the tables' gradients are not
        # finite (DeepSpeed would see finite gradients and apply its update).
        with engine_update_discarded(self.engine) if skip else nullcontext():
            self.engine.step()
        step_optimizers(self.optimizers, self.schedulers, skip)
