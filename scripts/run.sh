#!/usr/bin/env bash
# The main job (README): sets up .venv if needed, then validates the plugin against
# Transformer Engine's recorded outputs embedded in the repository (tests/data/te_golden).
# Extra arguments go to the validate command, e.g. `bash scripts/run.sh --backend reference`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
exec "$VENV/bin/python" -m primus_fp8_plugin.validate --golden tests/data/te_golden "$@"
