"""What assembles a run and owns the one training step.

The model placed on this rank (model_parts.py: pipeline stages, parallelisms, materialised and
initialised), the training step every caller runs (step.py: the recipes, the trial step behind
check_cluster's `real_step` and benchmarks/bench_mfu.py), the trial step on a config's cut
(trial_step.py) and the DeepSpeed engine's glue and files (deepspeed_engine.py,
deepspeed_files.py). It sits above parallelisms/ (it calls the placement code) and below the
planner and the entry points; nothing in engram/ or parallelisms/ imports it.
"""
