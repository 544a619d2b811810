"""The pieces of training that both recipes (recipes/train.py, recipes/train_deepspeed.py) and
runner/ call; the one step's order is runner/step.py's, and what an engine does differently is
runner/'s (engine_step.py, deepspeed_engine.py).

- `build.py`: what both recipes build before their loop (process, tokenizer / hasher / model on
  meta, data loaders, checkpoint manager).
- `step.py`: one step's pieces (forward-backward of a micro-batch or through the pipeline
  schedule, the data-parallel mean, the update or its skip with the schedules).
- `loss.py`: the loss (whole or chunked cross-entropy), one place for the step, the pipeline's
  last stage and evaluation.
- `nonfinite.py`: the non-finite guard (skip a step whose loss or gradients are not finite).
- `evaluate.py`: the held-out loss during training, through the same loss and pipeline.
- `progress.py`: the loop's running record (checkpointed counters, per-step loss and gradient
  norm, a log step's metrics).
- `metrics.py`: per-step metrics (metrics.jsonl, console, TensorBoard).
- `telemetry.py`: the log step's Engram and table-tier telemetry (gates, rows touched, the
  table update's size, NVMe page I/O; docs/telemetry.md), read with one all-reduce.
- `flops.py`: FLOPs per token of the model as built (the numerator of TFLOP/s and MFU).
- `throughput.py`: the throughput keys of a log step (tflops, mfu, device memory, data time)
  and the start-up device-memory log.
- `profiling.py`: torch.profiler windows and memory snapshots.
- `table_check.py`: the start-up warning for tables too small for the tokenizer.

A new per-step metric, guard or loss goes here; a change to the step's order goes in
runner/step.py, and an engine's own backward / clip / update in runner/.
"""
