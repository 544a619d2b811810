"""Console, TensorBoard and metrics.jsonl logging of training metrics (rank 0 writes)."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from engram.config import JobConfig, Metrics, sections_to_toml

logger = logging.getLogger("engram")


def is_log_step(cfg: JobConfig, step: int) -> bool:
    """Whether step `step` writes its metrics: every metrics.log_freq steps and the last."""
    return step % cfg.metrics.log_freq == 0 or step == cfg.training.steps


def _fmt_value(key: str, value: float) -> str:
    if key == "lr":
        return f"lr {value:.1e}"
    if key == "loss" or key.endswith("_loss"):
        return f"{key} {value:.4f}"
    if key == "tokens_per_s":
        return f"tok/s {value:,.0f}"
    if key in ("mfu", "mfu_indicative", "max_active_pct", "max_reserved_pct", "data_pct"):
        return f"{key} {value:.1f}%"
    if key == "data_time_s":
        return f"{key} {value:.3f}"
    if key == "mem_gib":
        return f"mem {value:.1f} GiB"
    if key.endswith("_gib"):
        return f"{key[:-4]} {value:.2f} GiB"
    if isinstance(value, int) or (math.isfinite(value) and float(value).is_integer()):
        return f"{key} {int(value):,}"
    return f"{key} {value:.4g}"


def format_metrics(step: int, metrics: dict[str, float]) -> str:
    """'step 10 | loss 3.2100 | lr 3.0e-04 | grad_norm 1.23 | tok/s 12,345 | mem 1.2 GiB'."""
    return " | ".join([f"step {step}"] + [_fmt_value(k, v) for k, v in metrics.items()])


def _to_float(key: str, value: Any) -> float:
    try:
        return float(value)  # python / numpy numbers and one-element tensors
    except (TypeError, ValueError):
        raise TypeError(
            f"metric {key!r} must be a number or a one-element tensor, got {type(value).__name__}"
        ) from None


class MetricsLogger:
    """Rank 0: console line, TensorBoard scalars and one JSON object per logged step in
    `<run_folder>/metrics.jsonl` (appended, flushed each step, so a crash loses nothing and a
    resumed run continues the file). Other ranks write nothing."""

    def __init__(
        self,
        run_folder: Path,
        cfg: Metrics,
        rank: int,
        config_dict: dict[str, Any] | None = None,
    ):
        self.cfg = cfg
        self.rank = rank
        self.run_folder = Path(run_folder)
        self.writer = None
        self.jsonl = None
        if rank != 0:
            return
        self.run_folder.mkdir(parents=True, exist_ok=True)
        if config_dict is not None:
            (self.run_folder / "config.json").write_text(
                json.dumps(config_dict, indent=2, sort_keys=True) + "\n"
            )
            if all(isinstance(v, dict) for v in config_dict.values()):
                (self.run_folder / "config.toml").write_text(sections_to_toml(config_dict))
        if cfg.enable_tensorboard:
            # Imported here: tensorboard start-up is slow and only rank 0 needs it.
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_folder / cfg.tb_folder))
            if config_dict is not None:
                text = json.dumps(config_dict, indent=2, sort_keys=True)
                self.writer.add_text("config", "```\n" + text + "\n```", 0)
        self.jsonl = (self.run_folder / "metrics.jsonl").open("a")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        values = {k: _to_float(k, v) for k, v in metrics.items()}
        logger.info(format_metrics(step, values))
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        if self.jsonl is not None:
            record = {"step": step, "time": round(time.time(), 3), **values}
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
