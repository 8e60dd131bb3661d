#!/usr/bin/env bash
# One GPU call with Transformer Engine (its wheels staged in .te/ beforehand; .te/small/device.sh
# installs them): record TE goldens, validate against them, GPU tests, and the benchmarks with TE as
# a contender.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
LOG="$OUT/session.log"
bash .te/small/device.sh install 2>&1 | tail -2 | tee -a "$LOG"
# megatron-core and hydra wheels carried in .whl/ (the GPU machine has no network) for tests/gpu's Megatron cases
if ls .whl/*.whl >/dev/null 2>&1; then
  pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2 | tee -a "$LOG"
fi
export PYTHONPATH="/tmp/te-site:/tmp/site:$PWD" PYTHONUNBUFFERED=1
G="${GOLDENS:-/tmp/te_goldens}"; mkdir -p "$G"
{
  python3 scripts/make_te_goldens.py --out "$G" 2>&1 | tail -1
  for b in reference triton cublas; do
    python3 -m primus_fp8_plugin.validate --golden "$G" --backend "$b" --device cuda | tail -1
  done
  python3 -m pytest -q -s tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | grep -E "vs TE|passed|failed|FAILED"
} 2>&1 | tee -a "$LOG"
for what in ${BENCHES-quant gemm linear}; do  # BENCHES="" runs none
  extra=""; [ "$what" = quant ] && extra="--variants"
  python3 "benchmarks/bench_$what.py" $extra --json "$OUT/bench_$what.json" --plot "$OUT/bench_$what.png" >> "$LOG" 2>&1
  echo "bench_$what rc=$?" | tee -a "$LOG"
done
tail -60 "$LOG"
