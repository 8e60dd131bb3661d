#!/usr/bin/env bash
# Launch the trainer (python -m primus_fp8_plugin.train) with torchrun: on one node, on several nodes,
# or inside a Slurm allocation.
#
#   scripts/launch_pretrain.sh [--gpus N] [--dry-run | --check] [HYDRA_OVERRIDES...]
#
#   --gpus N     processes per node (default: $GPUS_PER_NODE, else Slurm's $SLURM_GPUS_ON_NODE, else
#                every GPU torch sees, at least 1)
#   --dry-run    print the interpreter, the composed config (the trainer's --cfg job) and the exact
#                command(s); start nothing
#   --check      the same, and run the pre-launch check (below); start nothing
#   -h, --help   this text
# Everything else is a Hydra override for the trainer (python -m primus_fp8_plugin.train --help lists
# them); a later value of a key wins. Relative paths in overrides (logging.dir, checkpoint.dir,
# data.path, data.cache_dir) are relative to the directory you launch from.
#
# Python: $PYTHON if set; else the checkout's virtualenv $VENV/bin/python (VENV defaults to .venv,
# which scripts/setup_env.sh makes), if it exists; else python3 from PATH (the environment you launch
# from, e.g. an activated virtualenv or conda env). The one chosen must have torch, or the launch
# stops here saying so; it never falls back to another interpreter. The checkout goes first on
# PYTHONPATH, so its primus_fp8_plugin is the one that runs.
#
# Nodes:
#   one node (default)   torchrun --standalone --nproc-per-node N
#   several nodes        set NNODES, NODE_RANK (0 .. NNODES-1), MASTER_ADDR (node 0's address) and
#                        MASTER_PORT (default 29500) and run the same command on every node
#   Slurm, several nodes inside an allocation of several nodes (sbatch, salloc; SLURM_NNODES > 1) the
#                        script starts one task per node with srun, each running torchrun with
#                        --node-rank $SLURM_NODEID; MASTER_ADDR defaults to the allocation's first node.
#                        Submit with sbatch -N 4 --gpus-per-node 8 --wrap "scripts/launch_pretrain.sh ...",
#                        or from the checkout (sbatch runs a copy of a script file, which then finds the
#                        checkout through SLURM_SUBMIT_DIR).
#
# Before it starts any process the launcher composes the config and runs scripts/check_launch.py on
# it: the trainer's own validation for the world size (nodes x processes; batch sizes, TP, PP, ...)
# and the decoder spec the trainer builds for fp8.mode (that it holds the plugin's FP8 layers, and
# which attention it runs). One line says what is wrong, exit status 2. PRECHECK=0 skips it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$ROOT/scripts/launch_common.sh" ] || ROOT="${SLURM_SUBMIT_DIR:-$PWD}"  # sbatch runs a copy of this file
if [ ! -f "$ROOT/scripts/launch_common.sh" ]; then
  echo "[launch] error: cannot find the checkout (scripts/launch_common.sh) next to this script or in" \
       "SLURM_SUBMIT_DIR; run scripts/launch_pretrain.sh by its path in the checkout" >&2
  exit 2
fi
source "$ROOT/scripts/launch_common.sh"

usage() {
  if [ -n "${LAUNCH_RECIPE:-}" ]; then
    print_header "$LAUNCH_RECIPE"
    printf '\nThe recipe runs scripts/launch_pretrain.sh, whose options and environment apply:\n\n'
  fi
  print_header "$ROOT/scripts/launch_pretrain.sh"
}

GPUS="${GPUS_PER_NODE:-}"
MODE=launch
OVERRIDES=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) MODE=dry-run; shift ;;
    --check) MODE=check; shift ;;
    --gpus) [ $# -ge 2 ] || { echo "[launch] error: --gpus needs a number" >&2; exit 2; }; GPUS="$2"; shift 2 ;;
    --gpus=*) GPUS="${1#--gpus=}"; shift ;;
    --) shift; OVERRIDES+=("$@"); break ;;
    -m|--multirun)
      echo "[launch] error: the launcher starts one run; for a sweep run the launcher once per value" \
           "(or python -m primus_fp8_plugin.train -m ... on one process)" >&2
      exit 2 ;;
    -*)
      echo "[launch] error: unknown option $1 (the launcher takes --gpus N, --dry-run, --check, --help;" \
           "everything else is a Hydra override, key=value)" >&2
      exit 2 ;;
    *) OVERRIDES+=("$1"); shift ;;
  esac
done

find_python

# where this process stands: one node, one of several (torchrun's variables), or Slurm
IN_SLURM_STEP=0
if [ -n "${SLURM_JOB_ID:-}" ] && [ "${SLURM_NNODES:-1}" -gt 1 ]; then
  NNODES="$SLURM_NNODES"
  if [ -z "${MASTER_ADDR:-}" ]; then
    MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}" | sed -n 1p)" \
      || { echo "[launch] error: scontrol could not name the allocation's first node; set MASTER_ADDR" >&2; exit 2; }
  fi
  # inside a job step (one torchrun per node): the srun this script starts sets PRIMUS_FP8_SRUN_TASK; a step of
  # the user's own srun has a SLURM_STEP_ID (the batch script has none, or one of Slurm's special ids, 42949672xx)
  [ -n "${PRIMUS_FP8_SRUN_TASK:-}" ] && IN_SLURM_STEP=1
  case "${SLURM_STEP_ID:-}" in ''|42949672*) ;; *) IN_SLURM_STEP=1 ;; esac
  if [ "$IN_SLURM_STEP" = 1 ]; then
    if [ "${SLURM_STEP_NUM_TASKS:-$NNODES}" != "$NNODES" ]; then
      echo "[launch] error: this srun step has ${SLURM_STEP_NUM_TASKS} tasks on $NNODES nodes; run one task per node" \
           "(srun --ntasks-per-node=1), or call the launcher outside srun and it starts them" >&2
      exit 2
    fi
    NODE_RANK="${SLURM_NODEID:?}"
  fi
else
  NNODES="${NNODES:-1}"
  NODE_RANK="${NODE_RANK:-0}"
  if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    echo "[launch] error: NNODES=$NNODES needs MASTER_ADDR (node 0's address) and NODE_RANK on every node" >&2
    exit 2
  fi
fi
MASTER_PORT="${MASTER_PORT:-29500}"
if [ -z "$GPUS" ]; then
  GPUS="${SLURM_GPUS_ON_NODE:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
fi
case "$GPUS" in ''|*[!0-9]*|0) echo "[launch] error: --gpus must be a positive number, got '$GPUS'" >&2; exit 2 ;; esac

ENV=(env "PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1)  # Megatron's TP/SP overlap assumes it
TRAIN=(-m primus_fp8_plugin.train "${OVERRIDES[@]}")
if [ "$NNODES" -eq 1 ]; then
  CMD=("${ENV[@]}" "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$GPUS" "${TRAIN[@]}")
elif [ -n "${SLURM_JOB_ID:-}" ] && [ "$IN_SLURM_STEP" = 0 ]; then  # start one task per node, which re-enters here
  CMD=(srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1
       env PRIMUS_FP8_SRUN_TASK=1 PRECHECK=0 "MASTER_ADDR=$MASTER_ADDR" "MASTER_PORT=$MASTER_PORT" "PYTHON=$PYTHON"
       bash "$ROOT/scripts/launch_pretrain.sh" --gpus "$GPUS" -- "${OVERRIDES[@]}")
  NODE_RANK='$SLURM_NODEID'  # for the dry run's per-node command
else
  CMD=("${ENV[@]}" "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --node-rank="$NODE_RANK"
       --nproc-per-node="$GPUS" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" "${TRAIN[@]}")
fi

quoted() { local out; printf -v out '%q ' "$@"; printf '%s\n' "${out% }"; }
compose() { "${ENV[@]}" "$PYTHON" -m primus_fp8_plugin.train --cfg job "${OVERRIDES[@]}"; }
precheck() {
  local cfg
  cfg="$(compose)" || { echo "[launch] error: the configuration does not compose (see above)" >&2; exit 2; }
  printf '%s\n' "$cfg" | "${ENV[@]}" "$PYTHON" -W ignore "$ROOT/scripts/check_launch.py" --world-size "$((NNODES * GPUS))" - \
    || { echo "[launch] stopped before starting any process (PRECHECK=0 skips this check)" >&2; exit 2; }
}

if [ "$MODE" != launch ]; then
  echo "[launch] python: $PYTHON ($PYTHON_FROM)"
  echo "[launch] composed config (python -m primus_fp8_plugin.train --cfg job ...):"
  compose || { echo "[launch] error: the configuration does not compose (see above)" >&2; exit 2; }
  if [ "$MODE" = check ]; then
    precheck
  else
    echo "[launch] pre-launch check (--check runs it): $PYTHON scripts/check_launch.py --world-size $((NNODES * GPUS))"
  fi
  echo "[launch] $NNODES node(s) x $GPUS process(es); command:"
  quoted "${CMD[@]}"
  if [ "${CMD[0]}" = srun ]; then
    echo "[launch] each node's task then runs:"
    quoted "${ENV[@]}" "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --node-rank="$NODE_RANK" \
      --nproc-per-node="$GPUS" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" "${TRAIN[@]}"
  fi
  echo "[launch] $MODE: nothing started"
  exit 0
fi

if [ "${PRECHECK:-1}" = 1 ] && [ "$IN_SLURM_STEP" = 0 ]; then
  precheck
fi
echo "[launch] $NNODES node(s) x $GPUS process(es): $(quoted "${CMD[@]}")"
exec "${CMD[@]}"
