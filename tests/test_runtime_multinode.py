"""Multi-node launches through ./run_train.sh, end to end, on one machine.

Two `run_train.sh` "nodes" of two CPU processes each (gloo) train the debug model for 3 steps:
over 127.0.0.1 with a static rendezvous (NODE_RANK) and with c10d (RDZV_ENDPOINT), and, where we
are root and `ip netns` works, from two network namespaces joined by a veth pair so each node
has its own IP and interface (GLOO_SOCKET_IFNAME). Real multi-host and NPU/HCCL launches are not
exercised here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "debug_model.toml"
RECIPE = ROOT / "recipes" / "train.py"
STEPS = 3
BATCH, SEQ_LEN, WORLD = 2, 32, 4  # small and fast; 2 nodes x 2 processes
TIMEOUT_S = 120  # a healthy 2-node launch takes 12-35 s here; a torn-down peer hangs until this

pytestmark = pytest.mark.slow
needs_recipe = pytest.mark.skipif(
    not (CONFIG.exists() and RECIPE.exists()),
    reason="needs recipes/train.py and train_configs/debug_model.toml",
)

# Stand-in recipe for the launcher-only tests: joins the group, checks an all-reduce, reports.
PROBE_RECIPE = """
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from engram.runtime.distributed import destroy_distributed, init_distributed

rank, local_rank, world = init_distributed("cpu", timeout_s=120)
total = torch.tensor([float(rank)])
dist.all_reduce(total)
assert total.item() == world * (world - 1) / 2, total
Path(sys.argv[-1], f"rank{rank}").write_text(f"{local_rank} {world} {' '.join(sys.argv[1:])}")
destroy_distributed()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
        and not k.startswith(("TORCHELASTIC_", "RDZV_", "MASTER_"))
    }
    env.update(
        CONFIG_FILE=str(CONFIG),
        NGPU="2",
        NNODES="2",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    env.update(extra)
    return env


def _overrides(dump: Path) -> list[str]:
    return [
        f"--training.steps={STEPS}",
        f"--job.dump_folder={dump}",
        "--job.run_name=multinode",
        "--job.device=cpu",
        f"--training.local_batch_size={BATCH}",
        f"--training.seq_len={SEQ_LEN}",
        "--data.eval_batches=0",
        "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false",
        "--checkpoint.enable=false",
    ]


# A gloo worker used to abort now and then ("terminate called without an active exception",
# exit -6) when process groups held by FSDP reference cycles were torn down during interpreter
# shutdown (about 1 in 20 runs); destroy_distributed now collects them first (tests/
# test_runtime_teardown.py checks that). A -6 exit is still retried once, with a warning that carries the
# log, as a safety net on this loaded 2-core box; any other failure fails at once.
_TEARDOWN_ABORT = "exitcode: -6"


def _launch_nodes(commands: list[list[str]], envs: list[dict[str, str]], logs: Path) -> None:
    try:
        _launch_nodes_once(commands, envs, logs)
    except AssertionError as first:
        if _TEARDOWN_ABORT not in str(first):
            raise
        warnings.warn(f"retrying after a gloo teardown abort:\n{str(first)[-2000:]}", stacklevel=2)
        _launch_nodes_once(commands, envs, logs)


def _launch_nodes_once(commands: list[list[str]], envs: list[dict[str, str]], logs: Path) -> None:
    """Start one process per node, wait for all; on failure show each node's log tail."""
    procs, files = [], []
    try:
        for i, (cmd, env) in enumerate(zip(commands, envs, strict=True)):
            out = open(logs / f"node{i}.log", "w")  # closed in finally
            files.append(out)
            # Own session: on timeout we kill exactly this node's process group.
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + TIMEOUT_S
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in files:
            f.close()
    tails = "\n".join(
        f"--- node{i} ---\n" + (logs / f"node{i}.log").read_text()[-3000:]
        for i in range(len(commands))
    )
    assert codes is not None, f"nodes did not finish within {TIMEOUT_S} s\n{tails}"
    assert codes == [0] * len(commands), f"exit codes {codes}\n{tails}"
    assert "+ " in (logs / "node0.log").read_text(), "run_train.sh did not print the command"


def _check_metrics(dump: Path) -> None:
    path = dump / "multinode" / "metrics.jsonl"
    assert path.exists(), f"no metrics at {path}: {sorted(p.name for p in dump.rglob('*'))}"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = records[-STEPS:]  # a retried launch (see _launch_nodes) appends to the same file
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    # Tokens are counted over all ranks: this proves all 4 processes formed one world.
    assert [r["tokens_seen"] for r in records] == [
        s * WORLD * BATCH * SEQ_LEN for s in range(1, STEPS + 1)
    ], records
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in records), records


@needs_recipe
def test_two_nodes_static_rendezvous(tmp_path: Path) -> None:
    port = str(free_port())
    dump = tmp_path / "out"
    cmd = [str(ROOT / "run_train.sh"), *_overrides(dump)]
    envs = [_env(NODE_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in (0, 1)]
    _launch_nodes([cmd, cmd], envs, tmp_path)
    _check_metrics(dump)


@needs_recipe
def test_two_nodes_c10d_rendezvous(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    dump = tmp_path / "out"
    cmd = [str(ROOT / "run_train.sh"), *_overrides(dump)]
    envs = [_env(RDZV_ENDPOINT=endpoint, RDZV_ID=f"test{os.getpid()}") for _ in (0, 1)]
    _launch_nodes([cmd, cmd], envs, tmp_path)
    _check_metrics(dump)


# --- two hosts from network namespaces -----------------------------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _netns_usable() -> str | None:
    """None if we can create namespaces, else the reason to skip."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"engprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"ip netns add failed: {getattr(e, 'stderr', e)}"
    _ip("netns", "del", probe)
    return None


@contextmanager
def _two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two namespaces joined by a veth pair; yields (netns, interface, ip) per host.

    Addresses exist only inside the namespaces; both are always deleted on exit.
    """
    tag = os.getpid() % 100000
    subnet = 10 + tag % 240  # a per-run /24 inside 10.231.0.0/16, avoids clashes
    hosts = [
        (f"engns{tag}{s}", f"eng{tag}{s}", f"10.231.{subnet}.{i + 1}") for i, s in enumerate("ab")
    ]
    created: list[str] = []
    try:
        for ns, _, _ in hosts:
            _ip("netns", "add", ns)
            created.append(ns)
        (ns_a, if_a, _), (ns_b, if_b, _) = hosts
        _ip("link", "add", if_a, "type", "veth", "peer", "name", if_b)
        for ns, ifname, addr in hosts:
            _ip("link", "set", ifname, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in created:  # deleting a namespace also removes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        # If moving the pair into the namespaces failed it is still here; else this is a no-op.
        subprocess.run(["ip", "link", "del", hosts[0][1]], capture_output=True, timeout=30)


@needs_recipe
def test_two_hosts_in_network_namespaces(tmp_path: Path) -> None:
    """Static launch across two namespaces. (c10d across them also works with RDZV_CONF=is_host=1
    on node 0 and LOCAL_ADDR=<own IP> on each; checked by hand to keep CI short.)"""
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    dump = tmp_path / "out"
    port = str(free_port())
    with _two_hosts() as hosts:
        master_ip = hosts[0][2]
        cmds, envs = [], []
        for rank, (ns, ifname, _) in enumerate(hosts):
            cmds.append(["ip", "netns", "exec", ns, str(ROOT / "run_train.sh"), *_overrides(dump)])
            envs.append(
                _env(
                    NODE_RANK=str(rank),
                    MASTER_ADDR=master_ip,
                    MASTER_PORT=port,
                    GLOO_SOCKET_IFNAME=ifname,
                )
            )
        _launch_nodes(cmds, envs, tmp_path)
    _check_metrics(dump)


# --- launcher scripts alone (stand-in recipe, no training) -------------------------------------


def test_run_train_rejects_missing_config(tmp_path: Path) -> None:
    env = _env(CONFIG_FILE=str(tmp_path / "nope.toml"))
    res = subprocess.run(
        [str(ROOT / "run_train.sh")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 2
    assert res.stderr.startswith("run_train.sh: CONFIG_FILE")  # the error prefix, kept
    assert "nope.toml' does not exist" in res.stderr and "CONFIG_FILE=" in res.stderr


ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _launcher_env(tmp_path: Path, **user: str) -> dict[str, str]:
    """run_train.sh with TORCHRUN = a stand-in that prints the environment it was given."""
    stand_in = tmp_path / "print_env"
    stand_in.write_text("#!/bin/sh\nenv\n")
    stand_in.chmod(0o755)
    env = {k: v for k, v in _env(TORCHRUN=str(stand_in)).items() if k not in ALLOC_VARS}
    res = subprocess.run(
        [str(ROOT / "run_train.sh")], env={**env, **user}, cwd=ROOT, capture_output=True,
        text=True, timeout=30,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    seen = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
    return {var: seen.get(var) for var in ALLOC_VARS} | {"stdout": res.stdout}


def test_run_train_sets_allocator_defaults_and_keeps_the_users(tmp_path: Path) -> None:
    unset = _launcher_env(tmp_path)
    assert unset["PYTORCH_CUDA_ALLOC_CONF"] == unset["PYTORCH_NPU_ALLOC_CONF"]
    assert unset["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    info = "run_train.sh info: PYTORCH_NPU_ALLOC_CONF=expandable_segments:True (default"
    assert info in unset["stdout"]
    # "run_train.sh:" starts an error (stderr) only, never an informational line.
    assert not [ln for ln in unset["stdout"].splitlines() if ln.startswith("run_train.sh:")]
    mine = _launcher_env(
        tmp_path, PYTORCH_NPU_ALLOC_CONF="", PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512"
    )
    assert mine["PYTORCH_NPU_ALLOC_CONF"] == ""  # set, even empty: the user's choice
    assert mine["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert "(default" not in mine["stdout"]
    # torch's device-neutral name is a choice for CUDA too.
    neutral = _launcher_env(tmp_path, PYTORCH_ALLOC_CONF="expandable_segments:False")
    assert neutral["PYTORCH_CUDA_ALLOC_CONF"] is None
    assert neutral["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"


FAKE_SCONTROL = """#!/bin/bash
echo localhost; echo node-b
"""
# Stand-in srun: runs the command once per node on this machine with SLURM_NODEID set.
FAKE_SRUN = """#!/bin/bash
n=1
while [[ "$1" == --* ]]; do case "$1" in --ntasks=*) n="${1#--ntasks=}";; esac; shift; done
pids=()
for ((i = 0; i < n; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""


def test_slurm_script_with_stand_in_srun(tmp_path: Path) -> None:
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE_RECIPE)
    config = tmp_path / "job.toml"
    config.write_text("")
    env = _env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_JOB_NODELIST="localhost,node-b",
        SLURM_NNODES="2",
        NGPU="1",
        MASTER_PORT=str(free_port()),
        CONFIG_FILE=str(config),
        TRAIN_SCRIPT=str(probe),
    )
    cmd = ["bash", str(ROOT / "scripts" / "slurm_train.sh"), "--training.steps=1", str(out)]
    _launch_nodes([cmd], [env], tmp_path)
    log = (tmp_path / "node0.log").read_text()
    assert "2 nodes x 1 devices, master localhost" in log, log
    assert log.count("--nnodes=2") == 2 and "--node_rank=1" in log, log
    for rank in (0, 1):  # one process per node: local rank 0, world 2, args passed through
        text = (out / f"rank{rank}").read_text()
        assert text == f"0 2 --job.config_file {config} --training.steps=1 {out}", text
