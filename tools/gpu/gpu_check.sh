#!/usr/bin/env bash
# Everything we check on the GPU machine in one call: GPU tests, validate per backend, benchmarks.
# Usage (device tool): bash tools/gpu/gpu_check.sh [quick]   -- writes logs/JSON/PNGs to $OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q tests/gpu tests/backends -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
for b in triton cublas; do
  python3 -m primus_fp8_plugin.validate --golden tests/data/te_golden --backend "$b" --device cuda > "$OUT/validate_$b.log" 2>&1
  echo "validate $b: rc=$? $(tail -1 "$OUT/validate_$b.log")"
done
[ "${1:-}" = "quick" ] && exit 0
python3 benchmarks/bench_quant.py --variants --json "$OUT/bench_quant.json" --plot "$OUT/bench_quant.png" 2>&1 | tee "$OUT/bench_quant.log" | tail -30
python3 benchmarks/bench_gemm.py --json "$OUT/bench_gemm.json" --plot "$OUT/bench_gemm.png" > "$OUT/bench_gemm.log" 2>&1
tail -35 "$OUT/bench_gemm.log"
