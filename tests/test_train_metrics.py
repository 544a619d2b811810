import json
import logging
import math

import pytest
import tomllib
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from engram.config import JobConfig, Metrics, Profiling
from engram.train.metrics import MetricsLogger, format_metrics
from engram.train.profiling import maybe_profile, profile_schedule


def _metrics(step: int) -> dict[str, float]:
    return {
        "loss": 3.0 / step,
        "lr": 1e-4 * step,
        "grad_norm": 0.5 + step,
        "tokens_per_s": 1000.0 * step,
        "mem_gib": 0.25,
    }


def test_rank0_writes_jsonl_tensorboard_and_config(tmp_path, caplog):
    cfg = JobConfig()
    steps = [1, 2, 5]
    logger = MetricsLogger(tmp_path, Metrics(), rank=0, config_dict=cfg.to_dict())
    with caplog.at_level(logging.INFO, logger="engram"):
        logging.getLogger("engram").addHandler(caplog.handler)
        try:
            for s in steps:
                logger.log(s, {**_metrics(s), "tensor_metric": torch.tensor(float(s))})
        finally:
            logging.getLogger("engram").removeHandler(caplog.handler)
    logger.close()

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == steps
    for r, s in zip(rows, steps, strict=True):
        for k, v in _metrics(s).items():
            assert math.isclose(r[k], v)
        assert r["tensor_metric"] == float(s)

    assert "step 5 | loss 0.6000 | lr 5.0e-04 | grad_norm 5.5 | tok/s 5,000 | mem 0.2 GiB" in (
        caplog.text
    )

    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mem_gib"} <= tags
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == steps
    assert [e.value for e in loss] == pytest.approx([3.0 / s for s in steps], rel=1e-6)

    assert json.loads((tmp_path / "config.json").read_text()) == cfg.to_dict()
    assert tomllib.loads((tmp_path / "config.toml").read_text()) == json.loads(
        json.dumps(cfg.to_dict())
    )


def test_jsonl_appends_on_resume(tmp_path):
    cfg = Metrics(enable_tensorboard=False)
    for s in (1, 2):
        logger = MetricsLogger(tmp_path, cfg, rank=0)
        logger.log(s, {"loss": float(s)})
        logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert not (tmp_path / "tb").exists()


def test_nonzero_rank_writes_nothing(tmp_path):
    run = tmp_path / "run"
    logger = MetricsLogger(run, Metrics(), rank=1, config_dict=JobConfig().to_dict())
    logger.log(1, _metrics(1))
    logger.close()
    assert not run.exists()


def test_bad_metric(tmp_path):
    logger = MetricsLogger(tmp_path, Metrics(log_freq=5, enable_tensorboard=False), rank=0)
    with pytest.raises(TypeError, match="metric 'loss'"):
        logger.log(1, {"loss": "high"})
    logger.close()


def test_format_metrics():
    assert format_metrics(10, _metrics(10) | {"mem_gib": 1.2, "tokens_per_s": 12345.4}) == (
        "step 10 | loss 0.3000 | lr 1.0e-03 | grad_norm 10.5 | tok/s 12,345 | mem 1.2 GiB"
    )


def test_profile_schedule():
    for freq in (1, 2, 4, 10):
        wait, warmup, active = profile_schedule(freq)
        assert min(wait, warmup) >= 0 and active == 1 and wait + warmup + active == freq


def test_profiler_writes_trace(tmp_path):
    cfg = Profiling(enable_profiling=True, profile_freq=3)
    x = torch.randn(16, 16)
    with maybe_profile(cfg, tmp_path, rank=1, device_type="cpu") as prof:
        for _ in range(7):
            (x @ x).relu().sum()
            prof.step()
    traces = sorted(p.name for p in (tmp_path / cfg.traces_folder / "rank1").iterdir())
    # Steps 3 and 6 are recorded (1-indexed), step 7 is mid-cycle.
    assert traces == ["rank1.3.pt.trace.json", "rank1.6.pt.trace.json"]
    trace = json.loads((tmp_path / cfg.traces_folder / "rank1" / traces[0]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::matmul" in names


def test_profiler_disabled_is_noop(tmp_path):
    with maybe_profile(Profiling(), tmp_path, rank=0) as prof:
        prof.step()
    assert not any(tmp_path.iterdir())
