#!/usr/bin/env bash
# BF16 vs TE blockwise vs the plugin: the same 125M GPT, data and seed, 2000 steps each, then a plot
# and a table (docs/CONVERGENCE.md). te_bf16 (TE's spec without FP8) is TE's own BF16 control: TE's
# spec differs from Megatron's local one in more than FP8. The TE arms run only where Transformer
# Engine imports (elsewhere they stop at start-up and are left out).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/compare_convergence.py --out outputs/convergence_125m \
  --run bf16="fp8=bf16" --run plugin="fp8=blockwise" --run te="fp8=te_blockwise" --run te_bf16="fp8=te_bf16" \
  -- model=gpt_125m train=convergence "$@"
