#!/usr/bin/env bash
# A small MoE proxy (8 experts, top-2) with FP8 blockwise linears in attention and grouped FP8 experts
# (one grouped GEMM per pass for all experts; model.moe_grouped_gemm=false: a GEMM per expert).
exec "$(dirname "$0")/../scripts/launch_pretrain.sh" \
  model=moe_small model.moe_grouped_gemm=true fp8=blockwise train.steps=2000 train.global_batch_size=32 train.warmup_steps=100 \
  logging.dir=outputs/moe_small "$@"
