"""The training-step pieces both recipes share (recipes/train.py, recipes/train_deepspeed.py).

- `loss.py`: the loss (whole or chunked cross-entropy), one place for the recipe, the pipeline's
  last stage and evaluation.
- `nonfinite.py`: the non-finite guard (skip a step whose loss or gradients are not finite).
- `metrics.py`: per-step metrics (metrics.jsonl, console, TensorBoard).
- `flops.py`: FLOPs per token of the model as built (the numerator of TFLOP/s and MFU).
- `throughput.py`: the throughput keys of a log step (tflops, mfu, device memory, data time)
  and the start-up device-memory log.
- `profiling.py`: torch.profiler windows and memory snapshots.
- `table_check.py`: the start-up warning for tables too small for the tokenizer.

A new per-step metric, guard or loss goes here; what differs per engine stays in the recipe.
"""
