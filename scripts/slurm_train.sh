#!/bin/bash
# Slurm batch script: one run_train.sh (one torchrun agent) per node, NGPU processes per node.
#
#   CONFIG_FILE=train_configs/32b_npu.toml sbatch scripts/slurm_train.sh [--section.key=value ...]
#   CONFIG_FILE=train_configs/32b_gpu.toml sbatch --nodes=2 scripts/slurm_train.sh
#
# Defaults: 8 nodes x 8 devices. Override with `sbatch --nodes=N`, NGPU=..., MASTER_PORT=...
# Network variables (NCCL_*, HCCL_*, GLOO_SOCKET_IFNAME) are exported to every node by sbatch's
# default --export=ALL: set them before sbatch or below. See docs/multinode.md.
#SBATCH --job-name=engram-train
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=slurm-%x-%j.out
# Request the devices the way your site defines them, e.g. (remove one '#' to enable):
##SBATCH --gpus-per-node=8
##SBATCH --gres=npu:8
set -euo pipefail

# sbatch runs a copy of this script from a spool directory: work from the submit directory.
cd "${SLURM_SUBMIT_DIR:-$PWD}"

if [[ -z "${CONFIG_FILE:-}" ]]; then
    echo "slurm_train.sh: set CONFIG_FILE, e.g. CONFIG_FILE=train_configs/32b_npu.toml sbatch $0" >&2
    exit 2
fi

# Node 0 of the allocation hosts the rendezvous store; its hostname must resolve on every node
# (else export MASTER_ADDR=<its IP on the training network> before sbatch).
export MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
export MASTER_PORT="${MASTER_PORT:-29500}"
export NNODES="${SLURM_NNODES}"
export NGPU="${NGPU:-8}"
export CONFIG_FILE

echo "slurm_train.sh: ${NNODES} nodes x ${NGPU} devices, master ${MASTER_ADDR}:${MASTER_PORT}"

# One task per node; NODE_RANK comes from SLURM_NODEID, evaluated on each node.
srun --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash -c 'NODE_RANK="$SLURM_NODEID" exec ./run_train.sh "$@"' run_train "$@"
