#!/usr/bin/env bash
# Creates (or reuses) the project virtualenv at $VENV (default .venv) with everything the tests
# and the main job need. Sourced by scripts/test.sh and scripts/run.sh; safe to run again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"  # CPU build; lies on disk on our CI machines

stamp="$VENV/.primus-fp8-setup"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  return 0 2>/dev/null || exit 0
fi
echo "[setup] creating virtualenv $VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "[setup] installing $TORCH_SPEC"
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
echo "[setup] installing primus-fp8-plugin[dev] (editable)"
"$VENV/bin/python" -m pip install -q -e "$ROOT[dev]"
# megatron-core 0.19.2 declares Python >= 3.12 but megatron.core runs on 3.11 (docs/MEGATRON.md, "CPU contract"); its
# declared dependencies pull in far more than megatron.core needs, so install it alone plus those.
echo "[setup] installing megatron-core 0.19.2"
"$VENV/bin/python" -m pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
"$VENV/bin/python" -m pip install -q "packaging" "psutil" "einops" "hydra-core>=1.3" "omegaconf>=2.3" "tqdm"
# FlyDSL (AMD gfx950 backend), compile-only here: it needs ld.lld and the AMD device bitcode.
echo "[setup] installing flydsl and the gfx950 toolchain (lld-19, rocm-device-libs)"
"$VENV/bin/python" -m pip install -q "flydsl>=0.5"
if ! { [ -e /usr/lib/llvm-19/bin/ld.lld ] && [ -d /usr/lib/x86_64-linux-gnu/amdgcn/bitcode ]; } && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q lld-19 rocm-device-libs >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q lld-19 rocm-device-libs >/dev/null 2>&1
  } || echo "[setup] warning: could not install lld-19 / rocm-device-libs; the FlyDSL compile test will fail" >&2
fi
echo "$want" > "$stamp"
