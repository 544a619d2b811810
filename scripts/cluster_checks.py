"""The checks of scripts/check_cluster.py: what each row runs on every rank (collectives with
known values, the row-sharded Engram lookup, FSDP2 + bf16, DCP, bandwidth, TP, memory). Each
check returns its detail text, raises on a failure and raises `Skip` where it does not apply;
check_cluster.py's `Checker` runs them in order, gathers every rank's outcome and prints the
table.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engram.runtime import device as dev


class Skip(Exception):
    """Raised by a check that does not apply here (e.g. inter-node on one node)."""


class ClusterChecks:
    """The checks, on this rank (see the module docstring)."""

    def __init__(self, device: torch.device, device_type: str, args: argparse.Namespace) -> None:
        self.device, self.device_type, self.args = device, device_type, args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Results travel over a separate CPU (gloo) group: it works even when the device
        # backend's communicator is broken by a failed check.
        self.meta = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self._mesh = None
        self.hosts: list[str] = self.gather_obj(socket.gethostname())

    def gather_obj(self, obj):
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.meta)
        return out

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
