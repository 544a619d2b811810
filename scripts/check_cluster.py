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

A check that raises on one rank while the others wait in a collective stalls until the process
group timeout (--timeout). After a FAIL, later checks may fail too (a broken communicator): fix the
first FAIL first. ENGRAM_CHECK_INJECT="name[,name]" makes the named checks fail in the harness
before they run, as a backend rejection would (used by the tests; never set it for a real check).
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import socket
import sys
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from engram.config import load_config  # noqa: E402
from engram.runtime import device as dev  # noqa: E402
from engram.runtime.distributed import destroy_distributed, init_distributed  # noqa: E402
from engram.runtime.logs import init_logging  # noqa: E402
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


class Skip(Exception):
    """Raised by a check that does not apply here (e.g. inter-node on one node)."""


class Checker:
    def __init__(self, device: torch.device, device_type: str, args: argparse.Namespace) -> None:
        self.device, self.device_type, self.args = device, device_type, args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Results travel over a separate CPU (gloo) group: it works even when the device
        # backend's communicator is broken by a failed check.
        self.meta = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.inject = {s.strip() for s in os.environ.get(INJECT_ENV, "").split(",") if s.strip()}
        self.rows: list[Row] = []
        self._mesh = None
        self.hosts: list[str] = self.gather_obj(socket.gethostname())

    # --- harness ------------------------------------------------------------------------------

    def gather_obj(self, obj):
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.meta)
        return out

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

    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(
                self.device_type, (self.world,), mesh_dim_names=("check",)
            )
        return self._mesh

    def sync(self) -> None:
        dev.synchronize(self.device)

    # --- checks -------------------------------------------------------------------------------

    def check_init(self) -> str:
        seen = self.gather_obj(
            (self.hosts[self.rank], int(os.environ.get("LOCAL_RANK", 0)), str(self.device))
        )
        per_host: dict[str, list[tuple[int, str]]] = {}
        for host, local_rank, device in seen:
            per_host.setdefault(host, []).append((local_rank, device))
        if self.device_type != "cpu":
            for host, pairs in per_host.items():
                devices = [d for _, d in pairs]
                if len(set(devices)) != len(devices):
                    raise RuntimeError(f"host {host}: local ranks share a device: {sorted(pairs)}")
        hosts = "; ".join(
            f"{h}: " + ",".join(f"{lr}->{d}" for lr, d in sorted(p)) for h, p in per_host.items()
        )
        if len(hosts) > 300:
            hosts = hosts[:300] + " ..."
        env = ""
        if (
            self.device_type == "npu"
        ):  # what HCCL was started with (engram.runtime.device defaults or yours)
            names = (*dev.NPU_ENV_DEFAULTS, *dev.NPU_DETERMINISTIC_ENV)
            env = "; " + ", ".join(f"{k}={os.environ.get(k, '<unset>')}" for k in names)
        return f"{dist.get_backend()} on {len(per_host)} host(s), local rank->device: {hosts}{env}"

    def check_all_reduce(self) -> str:
        t = torch.full((1024,), float(self.rank + 1), device=self.device)
        dist.all_reduce(t)
        expected = self.world * (self.world + 1) / 2
        if not torch.all(t == expected):
            raise AssertionError(f"sum is {t[0].item()}, expected {expected}")
        return f"fp32 sum over {self.world} ranks correct"

    def check_reduce_scatter(self) -> str:
        n = 16
        inp = torch.arange(n * self.world, dtype=torch.float32, device=self.device) + self.rank
        out = torch.empty(n, device=self.device)
        dist.reduce_scatter_tensor(out, inp)
        base = torch.arange(n, dtype=torch.float32, device=self.device) + n * self.rank
        expected = base * self.world + sum(range(self.world))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        return "reduce_scatter_tensor (fp32 sum) correct"

    def check_all_gather(self) -> str:
        inp = torch.full((8,), float(self.rank), device=self.device)
        out = torch.empty(8 * self.world, device=self.device)
        dist.all_gather_into_tensor(out, inp)
        expected = torch.arange(
            self.world, dtype=torch.float32, device=self.device
        ).repeat_interleave(8)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        return "all_gather_into_tensor correct"

    def check_all_to_all(self, dtype: torch.dtype) -> str:
        # Rank s sends (s + d) % 3 + 1 elements to rank d (uneven, never empty); element k of
        # that block is 16 * s + d + k / 4 (its integer part for ints), rounded to the dtype the
        # same way on both sides: any mismatch is a transport error.
        def block(s: int, d: int) -> torch.Tensor:
            n = (s + d) % 3 + 1
            vals = torch.arange(n, dtype=torch.float64) / (4 if dtype.is_floating_point else 1)
            return (16 * s + d + vals).to(dtype)

        send = torch.cat([block(self.rank, d) for d in range(self.world)]).to(self.device)
        in_splits = [(self.rank + d) % 3 + 1 for d in range(self.world)]
        out_splits = [(s + self.rank) % 3 + 1 for s in range(self.world)]
        out = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        dist.all_to_all_single(
            out, send, output_split_sizes=out_splits, input_split_sizes=in_splits
        )
        expected = torch.cat([block(s, self.rank) for s in range(self.world)]).to(self.device)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        return f"uneven splits {in_splits} (rank {self.rank} sends) correct"

    def check_engram_lookup(self, dtype: torch.dtype) -> str:
        from parallelisms.engram_tables import apply_engram_table_sharding

        rows, dim = 4 * self.world + 3, 8  # not divisible by the world: uneven shards
        gen = torch.Generator().manual_seed(1234)
        full = torch.randn(rows, dim, generator=gen).to(dtype)
        holder = nn.Module()
        holder.table = nn.Embedding(rows, dim, dtype=dtype, device=self.device)
        with torch.no_grad():
            holder.table.weight.copy_(full)
        apply_engram_table_sharding(
            holder, self.mesh(), dedup=True, grad_scale=1.0, table_types=(nn.Embedding,)
        )

        def batch(r: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(100 + r)
            ids = torch.randint(0, rows, (3, 7), generator=g)
            ids[0, :2] = r % rows  # a repeated id (dedup path)
            return ids, torch.randn(3, 7, dim, generator=g).to(dtype)

        ids, grad_out = batch(self.rank)
        out = holder.table(ids.to(self.device))
        # The forward only moves rows: exact. The backward sums duplicate rows in another order.
        torch.testing.assert_close(out.cpu(), F.embedding(ids, full), rtol=0, atol=0)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        out.backward(grad_out.to(self.device))
        ref_grad = torch.zeros(rows, dim, dtype=torch.float32)
        for r in range(self.world):  # owners receive the sum over ranks (grad_scale = 1)
            ids_r, g_r = batch(r)
            ref_grad.index_add_(0, ids_r.reshape(-1), g_r.reshape(-1, dim).float())
        grad = holder.table.weight.grad
        local = (grad.to_local() if hasattr(grad, "to_local") else grad).float().cpu()
        start = self.rank * (-(-rows // self.world))
        torch.testing.assert_close(local, ref_grad[start : start + local.shape[0]], **tol)
        cfg_dtype = getattr(self.args.cfg.parallelism, "engram_a2a_dtype", None)
        note = f"; parallelism.engram_a2a_dtype={cfg_dtype}" if cfg_dtype else ""
        return f"{rows} rows over {self.world} ranks: forward and backward equal F.embedding{note}"

    def _tiny_model(self) -> nn.Module:
        torch.manual_seed(0)
        dim, rows = 16, 4 * self.world + 1

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x + self.down(F.gelu(self.up(x)))

        class Tiny(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.table = nn.Embedding(rows, dim)
                self.layers = nn.ModuleList([Block(), Block()])

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                h = self.table(ids)
                for layer in self.layers:
                    h = layer(h)
                return h

        return Tiny().to(self.device)

    def _fsdp_batch(self, r: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(500 + r)
        return torch.randint(0, rows, (2, 5), generator=g), torch.randn(2, 5, 16, generator=g)

    def check_fsdp(self) -> str:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from parallelisms.engram_tables import apply_engram_table_sharding

        lr, bf16 = 0.5, torch.bfloat16
        model = self._tiny_model()
        ref = copy.deepcopy(model)
        rows = model.table.weight.shape[0]
        tables = apply_engram_table_sharding(  # 1 / world: the data-parallel mean (no TP)
            model, self.mesh(), grad_scale=1.0 / self.world, table_types=(nn.Embedding,)
        )
        mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=self.mesh(), mp_policy=mp)
        fully_shard(model, mesh=self.mesh(), mp_policy=mp, ignored_params=set(tables))
        ids, target = self._fsdp_batch(self.rank, rows)
        out = model(ids.to(self.device))
        loss = (out.float() - target.to(self.device)).pow(2).mean()
        loss.backward()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        opt.step()

        # Single device: each rank's batch through a bf16 copy of the layers (what FSDP computes),
        # fp32 gradients averaged over the ranks, one SGD step on the fp32 weights.
        grads = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
        for r in range(self.world):
            low = copy.deepcopy(ref)
            low.layers.to(bf16)
            ids_r, target_r = self._fsdp_batch(r, rows)
            h = low.table(ids_r.to(self.device))
            for layer in low.layers:
                h = layer(h.to(bf16))
            (h.float() - target_r.to(self.device)).pow(2).mean().backward()
            for n, p in low.named_parameters():
                grads[n] += p.grad.float() / self.world
        worst = 0.0
        with torch.no_grad():
            for n, p in ref.named_parameters():
                expected = (p - lr * grads[n]).cpu()
                got = model.get_parameter(n)
                got = got.full_tensor() if hasattr(got, "full_tensor") else got
                torch.testing.assert_close(got.detach().cpu(), expected, rtol=1e-3, atol=1e-4)
                worst = max(worst, (got.detach().cpu() - expected).abs().max().item())
        self._fsdp_model = model
        return f"bf16 params / fp32 reduce, table ignored by FSDP: max |diff| {worst:.1e} vs single device"

    def check_dcp(self) -> str:
        import torch.distributed.checkpoint as dcp

        model = getattr(self, "_fsdp_model", None)
        if model is None:
            raise Skip("needs fsdp2_bf16_step to have built the model")
        folder = None
        if self.rank == 0:
            folder = str(
                Path(self.args.cfg.job.dump_folder) / "check_cluster" / uuid.uuid4().hex[:8]
            )
        folder = self.gather_obj(folder)[0]
        try:
            sd = model.state_dict()
            saved = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                for k, v in sd.items()
            }
            dcp.save(sd, checkpoint_id=folder)
            with torch.no_grad():
                for v in sd.values():
                    (v.to_local() if hasattr(v, "to_local") else v).zero_()
            dcp.load(sd, checkpoint_id=folder)
            model.load_state_dict(sd)
            for k, v in model.state_dict().items():
                got = v.full_tensor() if hasattr(v, "full_tensor") else v
                torch.testing.assert_close(got.detach().cpu(), saved[k], rtol=0, atol=0)
            # Reshard on load: the row-sharded table read back as one full tensor on every rank.
            full = {"table.weight": torch.zeros_like(saved["table.weight"])}
            dcp.load(full, checkpoint_id=folder)
            torch.testing.assert_close(full["table.weight"], saved["table.weight"], rtol=0, atol=0)
        finally:
            self.gather_obj(None)  # every rank done reading before the folder goes
            if self.rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
        return f"{len(saved)} tensors (FSDP DTensors + Shard(0) table) round-trip; table reloads unsharded; in {Path(folder).parent}"

    def _pair_groups(self) -> dict[str, tuple[list[int], object]]:
        """One rank pair per class (rank 0 with a rank on its host / on another host); every rank
        creates every group (new_group is collective)."""
        same = [r for r in range(self.world) if r != 0 and self.hosts[r] == self.hosts[0]]
        other = [r for r in range(self.world) if self.hosts[r] != self.hosts[0]]
        groups = {}
        for cls, cands in (("intra-node", same), ("inter-node", other)):
            if cands:
                ranks = [0, cands[0]]
                groups[cls] = (ranks, dist.new_group(ranks))
            else:
                groups[cls] = ([], None)
        return groups

    def bandwidth(self, ranks: list[int], group) -> str:
        if self.rank not in ranks:
            return ""
        n = len(ranks)
        nbytes = self.args.bandwidth_mib << 20
        elems = (nbytes // 4) // n * n
        x = torch.ones(elems, device=self.device)
        y = torch.empty_like(x)
        gathered = torch.empty(elems * n, device=self.device)
        result = []
        for name, op in (
            ("all_to_all", lambda: dist.all_to_all_single(y, x, group=group)),
            ("all_gather", lambda: dist.all_gather_into_tensor(gathered, x, group=group)),
        ):
            op()  # warm-up (communicator set-up)
            self.sync()
            t0 = time.perf_counter()
            for _ in range(self.args.bandwidth_iters):
                op()
            self.sync()
            dt = (time.perf_counter() - t0) / self.args.bandwidth_iters
            # Bytes each rank sends to the others per call, over the time: the "bus" figure.
            moved = elems * 4 * (n - 1) / n if name == "all_to_all" else elems * 4 * (n - 1)
            result.append(f"{name} {moved / dt / 1e9:.2f} GB/s")
        return (
            f"ranks {ranks if n <= 4 else f'{n} ranks'}, {self.args.bandwidth_mib} MiB/rank: "
            + ", ".join(result)
        )

    def check_tp(self) -> str:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        torch.manual_seed(1)
        dim, hidden = 16, 8 * self.world
        mlp = nn.Sequential()
        mlp.add_module("up", nn.Linear(dim, hidden))
        mlp.add_module("act", nn.GELU())
        mlp.add_module("down", nn.Linear(hidden, dim))
        mlp = mlp.to(self.device)
        ref = copy.deepcopy(mlp)
        parallelize_module(mlp, self.mesh(), {"up": ColwiseParallel(), "down": RowwiseParallel()})
        x = torch.randn(4, dim, generator=torch.Generator().manual_seed(2)).to(self.device)
        out, ref_out = mlp(x), ref(x)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        out.square().sum().backward()
        ref_out.square().sum().backward()
        for n, p in ref.named_parameters():
            g = mlp.get_parameter(n).grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
        return f"ColwiseParallel + RowwiseParallel over {self.world} ranks: forward and grads equal"

    def check_memory(self) -> str:
        stats = self.gather_obj(dev.memory_stats(self.device))
        key = "peak_allocated_gib" if "peak_allocated_gib" in stats[0] else "max_rss_gib"
        worst = max(range(self.world), key=lambda r: stats[r][key])
        extra = ""
        if key == "peak_allocated_gib":
            extra = f" of {stats[worst]['capacity_gib']:.1f} GiB"
        return f"{key} {stats[worst][key]:.2f} GiB{extra} (largest: rank {worst})"

    # --- all of them ----------------------------------------------------------------------------

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
