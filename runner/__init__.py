"""What assembles a run and owns the one training step.

The model placed on this rank (model_parts.py: pipeline stages, parallelisms, materialised and
initialised; start_checks.py: what it refuses before step 1 by the planner's rules, drive space,
async-save host memory, the checkpoint folder, and the table tier's start-up lines); the one training step (step.py TrainStep: the context-parallel cut, host-table
prefetch, forward / backward per micro-batch or the pipeline schedule, clip, the non-finite
guard, the update), run by both recipes, by the trial step on a config's cut (trial_step.py:
check_cluster's `real_step`, benchmarks/bench_mfu.py) and, with the engine's parts
(engine_step.py), under DeepSpeed; what runs around the loop the recipes write out (loop.py
TrainRun: the data read ahead, record, evaluate, save; exact_match.py: the greedy answers its
evaluation scores on chat data); the DeepSpeed engine (deepspeed_engine.py, its settings and its
save watchdog: the reader of its step folders is
engram/checkpoint/deepspeed_folder.py, shared with export and generation). It sits above
parallelisms/ (it calls the placement code) and below the planner and the entry points; nothing
in engram/ or parallelisms/ imports it.
"""
