#!/usr/bin/env bash
# Launch `python -m primus_fp8_plugin.train` on one node (torchrun) or across nodes (Slurm srun).
#
#   scripts/launch_pretrain.sh [--gpus N] [HYDRA_OVERRIDES...]          one node, N processes (default: all GPUs)
#   sbatch -N 4 --gpus-per-node 8 scripts/launch_pretrain.sh [...]       inside a Slurm allocation: srun across nodes
#
# Environment: PYTHON (default: python3), MASTER_PORT (default 29500), CHECK_SPEC (default 1: before
# launching, `python -m primus_fp8_plugin.megatron.check_spec` imports and builds the plugin's Megatron
# spec once, so a missing megatron-core or a broken install fails here with one clear line, not in N ranks).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
GPUS=""
if [ "${1:-}" = "--gpus" ]; then GPUS="$2"; shift 2; fi
if [ -z "$GPUS" ]; then
  GPUS="$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron's TP/SP communication overlap assumes it
if [ "${CHECK_SPEC:-1}" = "1" ]; then
  "$PYTHON" -W ignore -m primus_fp8_plugin.megatron.check_spec primus_fp8_plugin.megatron fp8_gpt_fast_layer_spec \
    || { echo "[launch] the plugin's Megatron spec does not build here (see above); CHECK_SPEC=0 skips this check" >&2; exit 2; }
fi

if [ -n "${SLURM_JOB_ID:-}" ] && [ "${SLURM_NNODES:-1}" -gt 1 ]; then
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
  export MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}"
  echo "[launch] slurm: $SLURM_NNODES nodes x $GPUS processes, master $MASTER_ADDR:$MASTER_PORT"
  exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c \
    "cd '$ROOT' && $PYTHON -m torch.distributed.run --nnodes=$SLURM_NNODES --node-rank=\$SLURM_NODEID \
     --nproc-per-node=$GPUS --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT \
     -m primus_fp8_plugin.train $*"
fi
echo "[launch] one node: $GPUS processes"
cd "$ROOT"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$GPUS" -m primus_fp8_plugin.train "$@"
