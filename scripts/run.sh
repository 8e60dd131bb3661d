#!/usr/bin/env bash
# The main job (README): sets up .venv if needed, then trains the embedded default — a tiny GPT with
# the FP8 blockwise plugin on Python's standard-library sources (byte tokens), a few hundred steps,
# on the GPU if there is one, else the CPU. Extra arguments are Hydra overrides, e.g.
# `bash scripts/run.sh fp8=bf16 train.steps=100`. Metrics: outputs/run/metrics.jsonl.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
exec "$VENV/bin/python" -m primus_fp8_plugin.train "$@"
