#!/usr/bin/env bash
# BF16 vs TE blockwise vs the plugin: the same 125M GPT, data and seed, 2000 steps each, then a plot and
# a table (docs/CONVERGENCE.md). The noise band is BF16 against itself through other kernels: bf16_sdpa
# is the bf16 arm with PyTorch's fused attention in place of Megatron's unfused one (the same math,
# rounded differently). te_bf16 (TE's spec without FP8) is TE's own BF16 control: TE's spec differs from
# Megatron's local one in more than FP8. The TE arms run only where Transformer Engine imports
# (elsewhere they stop at start-up and are left out).
#
#   recipes/convergence_125m.sh [--dry-run] [--retrain] [--band NAME,NAME,...] [OVERRIDES...]
#
# Arguments go to scripts/compare_convergence.py: its options (--help lists them) and Hydra overrides
# for every arm, which win over the recipe's (e.g. train.steps=200). Outputs go to
# outputs/convergence_125m under the directory you run it from; an arm whose metrics are there already
# is not trained again. Python: as for scripts/launch_pretrain.sh ($PYTHON, else the checkout's .venv,
# else python3 from PATH; it must have torch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$ROOT/scripts/launch_common.sh" ] || ROOT="${SLURM_SUBMIT_DIR:-$PWD}"  # sbatch runs a copy of this file
source "$ROOT/scripts/launch_common.sh"
if has_flag --help "$@" || has_flag -h "$@"; then
  print_header "$ROOT/recipes/convergence_125m.sh"
  printf '\nscripts/compare_convergence.py --help:\n\n'
  find_python
  exec "$PYTHON" "$ROOT/scripts/compare_convergence.py" --help
fi
find_python
exec "$PYTHON" "$ROOT/scripts/compare_convergence.py" --out outputs/convergence_125m \
  --run bf16="fp8=bf16" --run bf16_sdpa="fp8=bf16 model.attention=sdpa" --run plugin="fp8=blockwise" \
  --run te="fp8=te_blockwise" --run te_bf16="fp8=te_bf16" --band bf16,bf16_sdpa \
  model=gpt_125m train=convergence "$@"
