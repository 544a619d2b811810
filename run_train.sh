#!/usr/bin/env bash
# Launch a training recipe on this node with torchrun.
#
#   CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh [--section.key=value ...]
#
# Environment (defaults in brackets):
#   CONFIG_FILE    TOML job config                                  [train_configs/debug_model.toml]
#   TRAIN_SCRIPT   the recipe to run (copy and edit your own)       [recipes/train.py]
#   NGPU           processes (devices) per node; 1 on a CPU machine [1]
#   NNODES         number of nodes                                  [1]
#   NODE_RANK      this node's index, 0..NNODES-1 (static launch)   [0]
#   MASTER_ADDR    address of node 0, reachable from every node     [127.0.0.1]
#   MASTER_PORT    TCP port on MASTER_ADDR for the rendezvous store [29500]
#   RDZV_ENDPOINT  host:port -> c10d rendezvous instead of static NODE_RANK
#   RDZV_ID        job id shared by all nodes of one c10d run      [engram]
#   RDZV_CONF      extra --rdzv_conf, e.g. is_host=1 on the node that hosts the store
#   LOCAL_ADDR     this node's own address (--local_addr), when hostnames do not resolve
#   LOG_RANK       local ranks whose output is shown, e.g. 0 or 0,1 [0]
#   TORCHRUN       launcher command          [torchrun, else python -m torch.distributed.run]
#   TORCHRUN_ARGS  extra launcher flags
#   MAX_RESTARTS   restart all processes up to N times after a failure (a killed rank, a lost
#                  node); each try resumes from the newest intact checkpoint. N > 0 (or
#                  --max-restarts in TORCHRUN_ARGS) switches to c10d rendezvous on
#                  MASTER_ADDR:MASTER_PORT with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the mode
#                  that survives a killed rank (torch issue 135712; docs/multinode.md)  [0]
# Device-specific variables (NCCL_*, HCCL_*, GLOO_SOCKET_IFNAME, ASCEND_RT_VISIBLE_DEVICES,
# TORCH_DEVICE_BACKEND_AUTOLOAD) pass through unchanged: see docs/multinode.md.
# Set here when unset, and echoed (the recipe also sets the HCCL timeouts from [comm] and logs
# every runtime default; docs/npu.md, "The first day on a cluster"):
#   PYTORCH_CUDA_ALLOC_CONF / PYTORCH_NPU_ALLOC_CONF   the allocator's expandable segments: fewer
#                  fragmentation OOMs on long runs       [expandable_segments:True]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_model.toml}"
TRAIN_SCRIPT="${TRAIN_SCRIPT:-$ROOT/recipes/train.py}"
NGPU="${NGPU:-1}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
LOG_RANK="${LOG_RANK:-0}"

if [[ ! -f "$CONFIG_FILE" ]]; then
    echo "run_train.sh: CONFIG_FILE '$CONFIG_FILE' does not exist (cwd: $PWD)." >&2
    echo "  Set it to a TOML job config, e.g. CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh" >&2
    exit 2
fi
if [[ ! -f "$TRAIN_SCRIPT" ]]; then
    echo "run_train.sh: TRAIN_SCRIPT '$TRAIN_SCRIPT' does not exist." >&2
    exit 2
fi

# Before torchrun, so every process has them before its first device allocation. A user's
# PYTORCH_ALLOC_CONF (torch's device-neutral name) counts as set for CUDA. Informational lines
# say "run_train.sh info:"; "run_train.sh:" starts an error only.
set_default() {
    if [[ -z "${!1+x}" ]]; then
        export "$1=$2"
        echo "run_train.sh info: $1=$2 (default; export $1 to choose)"
    fi
}
if [[ -z "${PYTORCH_ALLOC_CONF+x}" ]]; then
    set_default PYTORCH_CUDA_ALLOC_CONF expandable_segments:True
fi
set_default PYTORCH_NPU_ALLOC_CONF expandable_segments:True

if [[ -n "${TORCHRUN:-}" ]]; then
    read -r -a launcher <<<"$TORCHRUN"
elif command -v torchrun >/dev/null 2>&1; then
    launcher=(torchrun)
else
    launcher=(python -m torch.distributed.run)
fi

MAX_RESTARTS="${MAX_RESTARTS:-0}"
if [[ "${TORCHRUN_ARGS:-}" =~ --max[-_]restarts[=\ ]*([0-9]+) ]]; then
    MAX_RESTARTS="${BASH_REMATCH[1]}"
fi
cmd=("${launcher[@]}" --nnodes="$NNODES" --nproc_per_node="$NGPU")
if [[ "$MAX_RESTARTS" -gt 0 ]]; then
    # Restarts with the static launch (or a shared rendezvous TCP store) fail to re-rendezvous in
    # most tries after a rank is killed (torch issue 135712); c10d with the store not shared
    # recovered every time.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    cmd+=(--max-restarts="$MAX_RESTARTS")
fi
if [[ -z "${RDZV_ENDPOINT:-}" && "$MAX_RESTARTS" -gt 0 ]]; then
    cmd+=(--rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="${RDZV_ID:-engram}")
    if [[ -n "${RDZV_CONF:-}" ]]; then cmd+=(--rdzv_conf="$RDZV_CONF"); fi
elif [[ -n "${RDZV_ENDPOINT:-}" ]]; then
    # c10d rendezvous: ranks are assigned as nodes join; NODE_RANK is not used.
    cmd+=(--rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="${RDZV_ID:-engram}")
    if [[ -n "${RDZV_CONF:-}" ]]; then cmd+=(--rdzv_conf="$RDZV_CONF"); fi
else
    cmd+=(--node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
fi
if [[ -n "${LOCAL_ADDR:-}" ]]; then cmd+=(--local_addr="$LOCAL_ADDR"); fi
cmd+=(--role=rank --tee=3 --local-ranks-filter="$LOG_RANK")
if [[ -n "${TORCHRUN_ARGS:-}" ]]; then
    read -r -a extra <<<"$TORCHRUN_ARGS"
    for flag in "${extra[@]}"; do  # --max-restarts was taken above
        [[ "$flag" =~ ^--max[-_]restarts ]] || [[ "$flag" =~ ^[0-9]+$ && "${prev:-}" =~ ^--max[-_]restarts$ ]] || cmd+=("$flag")
        prev="$flag"
    done
fi
cmd+=("$TRAIN_SCRIPT" --job.config_file "$CONFIG_FILE" "$@")

echo "+ $(printf '%q ' "${cmd[@]}")"
exec "${cmd[@]}"
