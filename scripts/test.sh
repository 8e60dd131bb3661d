#!/usr/bin/env bash
# The test command (README): sets up .venv from scratch if needed, lints, runs the CPU test suite; the full run
# (no arguments) then runs the Megatron tests against the oldest supported megatron-core (scripts/test_oldest_megatron.sh).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k quantize`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
PY="$VENV/bin/python"

echo "[test] ruff"
"$PY" -m ruff check primus_fp8_plugin tools benchmarks tests scripts

echo "[test] pytest"
set +e
# two worker processes (pytest-xdist; TEST_WORKERS=0 runs in this process), each test file on one worker so that
# a module's fixtures run once; tests/conftest.py gives each worker its own ports
"$PY" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: that proves nothing, so it counts as a failure" >&2
  exit 1
fi
# the full run also builds and trains the specs against the oldest supported megatron-core (a second virtualenv)
if [ "$#" -eq 0 ]; then
  echo "[test] oldest supported megatron-core"
  set +e
  bash scripts/test_oldest_megatron.sh
  rc_oldest=$?
  set -e
  [ "$rc" -ne 0 ] || rc=$rc_oldest
fi
exit "$rc"
