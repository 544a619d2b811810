"""The memory planner: per-rank device memory of a config at its real world size, and candidate
layouts side by side, without the hardware (`python scripts/estimate_memory.py`, docs/memory_estimate.md).

    results       result types (RankMemory, MemoryEstimate, CommPerStep, ...)
    measure       exact bytes: the recipe's model section under a fake process group
    placement     every rank's numbers from DTensor's placement math
    fsdp_buffers  FSDP all-gather / reduce-scatter / accumulation buffers from the unit shapes
    activations   activation formulas per micro-batch, stage and rank
    comm          bytes received per optimizer step, per collective
    schedule      torch's pipeline action order walked for micro-batches in flight; bubble
    tables        Engram table state per table optimizer; replicated-table baselines
    estimate      estimate(): the steps above for one config at one world size
    layouts       layout names and their configs; --compare
    step_model    the rough step-time model of --compare
    compare       compare(): estimate() per layout, and the pick
    report        markdown of an estimate and of a comparison
    cli           the command line (scripts/estimate_memory.py)
"""
