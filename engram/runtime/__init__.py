"""The process runtime: which device, which process group, which CPUs.

- `device.py`: cpu / cuda / npu selection, lazy `torch_npu`, per-device settings and the
  device module's calls (synchronize, memory stats).
- `distributed.py`: process-group init / teardown for the chosen device's backend, and the
  groups a DTensor's local pieces are summed over (`shard_groups`, for gradient norms).
- `device_specs.py`: usable memory and dense bf16 / fp8 peaks per device model (matched by the
  name the device reports, or the planner's --device) with the device type's figure as the
  fallback, with sources (the planner's default budget; the recipe logs the measured total and
  the match beside it; MFU's denominator, or a GEMM measured on cpu).
- `affinity.py`: pins the process to its device's NUMA node (job.cpu_affinity = "numa").
- `filesystems.py`: which file system a path is on (/proc/mounts), free and total bytes, and
  the warning for a "drive" that is tmpfs or a network file system.
- `logs.py`: one console format for every logger of the repository ("[rank0] 12:00:00 WARNING
  ..."), set once at process start (`init_logging`).
- `faults.py`: deterministic fault points for tests (`ENGRAM_FAULTS`: kill -9 or an I/O error
  at the n-th pass of a named point); nothing happens unless the variable is set.

Nothing here knows about models or training; everything else may import it. A new device type
goes in `device.py`.
"""
