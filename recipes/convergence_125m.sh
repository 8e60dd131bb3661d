#!/usr/bin/env bash
# BF16 vs TE blockwise vs the plugin: the same 125M GPT, data and seed, 2000 steps each, then a plot
# and a table (docs/CONVERGENCE.md). Runs the TE arm only where Transformer Engine imports.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/compare_convergence.py --out outputs/convergence_125m \
  --run bf16="fp8=bf16" --run plugin="fp8=blockwise" --run te="fp8=te_blockwise" \
  -- model=gpt_125m train=convergence "$@"
