#!/usr/bin/env bash
# The main job (README): sets up .venv if needed, then trains the embedded default — a tiny GPT with
# the FP8 blockwise plugin on Python's standard-library sources (byte tokens), a few hundred steps,
# on the GPU if there is one, else the CPU. Extra arguments are Hydra overrides, e.g.
# `bash scripts/run.sh fp8=bf16 train.steps=100`. Metrics: the run's output directory,
# outputs/DATE/TIME/metrics.jsonl (printed at the end; logging.dir=DIR to choose it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
# OpenMP threads that sleep when idle instead of spinning: on a CPU shared with other processes the
# spinning threads of torch's thread pool burn the time slices that the busy ones need (the 10-step
# CPU run took 66 s spinning and 6.5 s passive, with other jobs running).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec "$VENV/bin/python" -m primus_fp8_plugin.train "$@"
