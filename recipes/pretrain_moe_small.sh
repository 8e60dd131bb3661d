#!/usr/bin/env bash
# A small MoE proxy (8 experts, top-2) with FP8 blockwise linears in attention and grouped FP8 experts
# (one grouped GEMM per pass for all experts; model.moe_grouped_gemm=false: a GEMM per expert), PyTorch's
# fused attention (model.attention=sdpa), on the standard-library corpus. One process per GPU of this
# node (data parallel; --gpus N to choose); 32 sequences per step in micro-batches of 4, so 1, 2, 4 or 8
# processes.
#
#   recipes/pretrain_moe_small.sh [--gpus N] [--dry-run | --check] [OVERRIDES...]
#
# Extra arguments are the launcher's options and Hydra overrides, which win over the recipe's. Outputs and
# checkpoints go to outputs/moe_small under the directory you run it from; running it again resumes that run
# (a changed setting stops it at start-up, naming the field: checkpoint.allow_changes=[...] accepts it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$ROOT/scripts/launch_pretrain.sh" ] || ROOT="${SLURM_SUBMIT_DIR:-$PWD}"  # sbatch runs a copy of this file
export LAUNCH_RECIPE="$ROOT/recipes/pretrain_moe_small.sh"
exec bash "$ROOT/scripts/launch_pretrain.sh" \
  model=moe_small model.moe_grouped_gemm=true model.attention=sdpa fp8=blockwise \
  train.steps=2000 train.global_batch_size=32 train.micro_batch_size=4 train.warmup_steps=100 \
  checkpoint=periodic logging.dir=outputs/moe_small "$@"
