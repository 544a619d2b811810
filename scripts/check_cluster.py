"""Cluster acceptance check: does everything this repo relies on work on these nodes?

Run it with the same launcher, nodes and environment as training (cuda, npu or cpu):

    TRAIN_SCRIPT=scripts/check_cluster.py CONFIG_FILE=train_configs/32b_npu.toml NGPU=8 NNODES=8 \\
        NODE_RANK=<k> MASTER_ADDR=<node0> ./run_train.sh [--tp] [--section.key=value ...]

It reads job.device / job.deterministic / job.dump_folder from the config (the model is not
built), applies the same device settings as training, and prints on rank 0 one table row per
check: PASS / FAIL / SKIP, the detail or the error text, and on FAIL the setting to change. Exit
status 1 if any check FAILs (every rank), 0 otherwise. The checks, in order:

    init                         backend and the device each local rank got (distinct per host)
    all_reduce / reduce_scatter / all_gather   fp32 sums and gathers with known values
    all_to_all_single[dtype]     uneven splits, int64 / int32 / bfloat16 / float32 payloads
    engram_lookup[dtype]         the row-sharded table lookup (parallelisms/engram_tables/lookup.py)
                                 equals F.embedding on the full table, forward and backward
    fsdp2_bf16_step              FSDP2 with ignored_params (the sharded table) + bf16 mixed
                                 precision: one SGD step equals a single-device step
    dcp_save_load                DCP save / load of the FSDP model and the row-sharded table in
                                 <dump_folder>/check_cluster (must be storage every rank sees)
    bandwidth[intra|inter-node|world]   timed all_to_all_single and all_gather_into_tensor
    tp_mlp                       with --tp: ColwiseParallel / RowwiseParallel MLP vs unsharded
    real_step                    one training step of the config cut to --step-layers layers at its
                                 layout (scripts/cluster_step.py): TFLOP/s, MFU, peak memory vs
                                 the planner's for the same cut (on cpu the widths shrink too)
    peak_memory                  the largest per-rank peak of the run

The checks themselves are scripts/cluster_checks.py; this file runs them and prints the table.
A check that raises on one rank while the others wait in a collective stalls until the process
group timeout (--timeout). After a FAIL, later checks may fail too (a broken communicator): fix the
first FAIL first. ENGRAM_CHECK_INJECT="name[,name]" makes the named checks fail in the harness
before they run, as a backend rejection would (used by the tests; never set it for a real check).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engram.config import load_config  # noqa: E402
from engram.runtime import device as dev  # noqa: E402
from engram.runtime.distributed import destroy_distributed, init_distributed  # noqa: E402
from engram.runtime.logs import init_logging  # noqa: E402
from scripts.cluster_checks import ClusterChecks, Skip  # noqa: E402
from scripts.cluster_step import real_step  # noqa: E402

A2A_DTYPES = (torch.int64, torch.int32, torch.bfloat16, torch.float32)
INJECT_ENV = "ENGRAM_CHECK_INJECT"

# Which setting to change when a check fails (printed under the FAIL).
A2A_DTYPE_FIX = (
    "the Engram table all-to-all carries rows in this dtype: set parallelism.engram_a2a_dtype = "
    '"float32" (torch_npu documents all_to_all_single for fp32 only), or keep the tables in float32'
)
FIXES = {
    "init": "check the launcher variables (NGPU <= devices per node, MASTER_ADDR / MASTER_PORT "
    "reachable, HCCL_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME = the training NIC)",
    "all_reduce": "the backend cannot reduce: check the interconnect and the collective library "
    "(NCCL / HCCL) version; nothing in this repo works until this passes",
    "reduce_scatter": "FSDP reduces gradients with reduce_scatter: use parallelism.dp_shard=1 with "
    "dp_replicate = world size (DDP) until the backend supports it",
    "all_gather": "FSDP gathers parameters with all_gather: use DDP (parallelism.dp_shard=1) until "
    "the backend supports it",
    "all_to_all_single[int64]": "the Engram lookup sends int64 ids: upgrade torch_npu / CANN "
    "(HCCL maps int64) or disable Engram (engram.enabled = false)",
    "all_to_all_single[int32]": "int32 payloads are not used by training today; informational",
    "all_to_all_single[bfloat16]": A2A_DTYPE_FIX,
    "all_to_all_single[float32]": "the Engram lookup needs a float all-to-all: upgrade the "
    "collective library, or disable Engram (engram.enabled = false)",
    "engram_lookup[float32]": "the sharded table lookup is wrong on this device: report it "
    "with this table; set engram.enabled = false to train without Engram meanwhile",
    "engram_lookup[bfloat16]": A2A_DTYPE_FIX,
    "fsdp2_bf16_step": 'set parallelism.mixed_precision_param = "float32" (and '
    'mixed_precision_reduce = "float32"), or use DDP (parallelism.dp_shard=1)',
    "dcp_save_load": "job.dump_folder must be one shared filesystem that every rank of every node "
    "can write and read (checkpoints go there); or disable checkpoint.enable",
    "bandwidth[intra-node]": "check the intra-node links (HCCS / NVLink) and the device order",
    "bandwidth[inter-node]": "check the NIC selection (HCCL_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) "
    "and the RoCE / InfiniBand setup",
    "bandwidth[world]": "check the interconnect",
    "tp_mlp": "keep parallelism.tp = 1 on this cluster (use FSDP / HSDP only)",
    "real_step": "the config's own step fails at its layout: fix the error shown (an out-of-memory "
    "names the planner's misfit: rerun scripts/estimate_memory.py with a smaller batch or more "
    "sharding) before a long run",
    "peak_memory": "",
}


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Row:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str


class Checker(ClusterChecks):
    """Runs the checks (scripts/cluster_checks.py) in order on every rank, one table row each:
    PASS only if every rank passed, else the first error and the setting to change."""

    def __init__(self, device: torch.device, device_type: str, args: argparse.Namespace) -> None:
        super().__init__(device, device_type, args)
        self.inject = {s.strip() for s in os.environ.get(INJECT_ENV, "").split(",") if s.strip()}
        self.rows: list[Row] = []

    def run(self, name: str, fn: Callable[[], str]) -> None:
        """Run `fn` on every rank; PASS only if every rank passed (the first error is shown)."""
        try:
            if name in self.inject:
                raise RuntimeError(
                    f"simulated backend rejection of {name} ({INJECT_ENV} is set; unset it)"
                )
            outcome = ("PASS", fn())
        except Skip as e:
            outcome = ("SKIP", str(e))
        except Exception as e:  # reported in the table; the check continues with the next row
            last = traceback.extract_tb(e.__traceback__)[-1]
            outcome = (
                "FAIL",
                f"{type(e).__name__}: {e} (at {Path(last.filename).name}:{last.lineno})",
            )
        outcomes = self.gather_obj(outcome)
        fails = [(r, d) for r, (s, d) in enumerate(outcomes) if s == "FAIL"]
        if fails:
            r, d = fails[0]
            where = f"{len(fails)}/{self.world} ranks failed; rank {r}: " if self.world > 1 else ""
            text = " | ".join(line.strip() for line in d.splitlines() if line.strip())
            self.rows.append(Row(name, "FAIL", (where + text)[:600]))
        elif any(s == "SKIP" for s, _ in outcomes):
            self.rows.append(Row(name, "SKIP", next(d for s, d in outcomes if s == "SKIP")))
        else:
            self.rows.append(Row(name, "PASS", outcomes[0][1]))

    def run_all(self) -> None:
        dev.reset_peak_memory(self.device)
        self.run("init", self.check_init)
        self.run("all_reduce", self.check_all_reduce)
        self.run("reduce_scatter", self.check_reduce_scatter)
        self.run("all_gather", self.check_all_gather)
        for dtype in A2A_DTYPES:
            self.run(
                f"all_to_all_single[{_short(dtype)}]", lambda d=dtype: self.check_all_to_all(d)
            )
        for dtype in (torch.float32, torch.bfloat16):
            self.run(f"engram_lookup[{_short(dtype)}]", lambda d=dtype: self.check_engram_lookup(d))
        self.run("fsdp2_bf16_step", self.check_fsdp)
        self.run("dcp_save_load", self.check_dcp)
        groups = self._pair_groups()
        for cls, (ranks, group) in groups.items():

            def pair(ranks=ranks, group=group, cls=cls) -> str:
                if group is None:
                    raise Skip(f"no {cls} rank pair ({len(set(self.hosts))} host(s))")
                return self.bandwidth(ranks, group)

            self.run(f"bandwidth[{cls}]", pair)
            # Rows come from rank 0, which is in every pair: keep its text.
        self.run("bandwidth[world]", lambda: self.bandwidth(list(range(self.world)), None))
        if self.args.tp:
            self.run("tp_mlp", self.check_tp)
        else:
            self.rows.append(Row("tp_mlp", "SKIP", "pass --tp to check tensor parallelism"))
        if self.args.step_layers:
            cfg, argv, n = self.args.cfg, self.args.cfg_argv, self.args.step_layers
            self.run("real_step", lambda: real_step(cfg, argv, self.device, n))
        else:
            self.rows.append(Row("real_step", "SKIP", "--step-layers 0"))
        self.run("peak_memory", self.check_memory)

    def table(self) -> str:
        width = max(len(r.name) for r in self.rows)
        lines = [
            f"check_cluster: {self.world} ranks on {len(set(self.hosts))} host(s), device "
            f"{self.device_type}, backend {dist.get_backend()}, torch {torch.__version__}",
            f"{'check'.ljust(width)}  result  detail",
        ]
        for r in self.rows:
            lines.append(f"{r.name.ljust(width)}  {r.status.ljust(6)}  {r.detail}")
            if r.status == "FAIL" and FIXES.get(r.name):
                lines.append(f"{''.ljust(width)}          fix: {FIXES[r.name]}")
        fails = [r.name for r in self.rows if r.status == "FAIL"]
        lines.append(
            f"RESULT: FAIL ({len(fails)} of {len(self.rows)}: {', '.join(fails)})"
            if fails
            else f"RESULT: PASS ({len(self.rows)} checks; SKIP rows did not apply)"
        )
        return "\n".join(lines)


# torch >= 2.13 renames these two collectives; FSDP2 and this check use the names every supported
# torch has (reduce_scatter_tensor / all_gather_into_tensor), so the rename warning is noise here.
warnings.filterwarnings(
    "ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", action="store_true", help="also check tensor parallelism")
    parser.add_argument(
        "--bandwidth-mib", type=int, default=0, help="MiB per rank (default: 64, 4 on cpu)"
    )
    parser.add_argument("--bandwidth-iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600, help="process-group timeout (s)")
    parser.add_argument("--step-layers", type=int, default=2, help="real_step's layers (0: skip)")
    args, rest = parser.parse_known_args(argv)
    args.cfg, args.cfg_argv = (
        load_config(rest),
        rest,
    )  # --job.config_file and --section.key=value, as in training
    return args


def run_checks(argv: list[str] | None = None) -> tuple[int, str]:
    """Run every check on this rank; return (exit status, table text: rank 0 only, else "")."""
    args = parse_args(argv)
    cfg = args.cfg
    device_type = dev.resolve_device_type(cfg.job.device)
    dev.import_device_backend(device_type)
    dev.apply_device_env(device_type, cfg.job.deterministic)  # the same settings as training
    rank, local_rank, _ = init_distributed(device_type, timeout_s=args.timeout)
    init_logging(rank)
    device = dev.local_device(device_type, local_rank)
    if not args.bandwidth_mib:
        args.bandwidth_mib = 4 if device_type == "cpu" else 64
    checker = Checker(device, device_type, args)
    checker.run_all()
    failed = any(r.status == "FAIL" for r in checker.rows)
    return int(failed), checker.table() if checker.rank == 0 else ""


def main(argv: list[str] | None = None) -> int:
    try:
        status, text = run_checks(argv)
        if text:
            print(text, flush=True)
        dist.barrier()
    finally:
        destroy_distributed()
    return status


if __name__ == "__main__":
    sys.exit(main())
