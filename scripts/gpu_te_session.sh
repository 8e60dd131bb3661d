#!/usr/bin/env bash
# One GPU call with Transformer Engine (staged first with ../shared/tools/te-on-device): record TE
# goldens, validate against them, GPU tests, and the benchmarks with TE as a contender.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
LOG="$OUT/session.log"
bash .te/small/device.sh install 2>&1 | tail -2 | tee -a "$LOG"
export PYTHONPATH="/tmp/te-site:$PWD" PYTHONUNBUFFERED=1
{
  python3 scripts/make_te_goldens.py --out "$OUT"
  for b in reference triton cublas; do
    python3 -m primus_fp8_plugin.validate --golden "$OUT" --backend "$b" --device cuda | tail -4
  done
  python3 -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tail -4
} 2>&1 | tee -a "$LOG"
python3 scripts/bench_quant.py --variants --json "$OUT/bench_quant.json" --plot "$OUT/bench_quant.png" 2>&1 | tee -a "$LOG" | tail -32
python3 scripts/bench_gemm.py --json "$OUT/bench_gemm.json" --plot "$OUT/bench_gemm.png" >> "$LOG" 2>&1
tail -28 "$LOG"
