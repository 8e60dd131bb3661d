#!/usr/bin/env bash
# Nsight Compute reports of our kernels and their baselines, on the GPU machine.
#   bash tools/gpu/gpu_ncu.sh OUTDIR "NAME:TARGET ARGS..." ...
# e.g. bash tools/gpu/gpu_ncu.sh /tmp/ncu "fwd_ours:gemm-fwd --impl ours" "fwd_cublas:gemm-fwd --impl cublas"
# For each NAME: NAME.ncu-rep, NAME_details.txt (throughput, occupancy, stall reasons) and
# NAME_sass.csv (per-instruction samples). Clocks are left alone (--clock-control none).
# Summarise them with: python -m tools.ncu summary OUTDIR/NAME ...
set -u
mkdir -p "$1"
out=$(cd "$1" && pwd)
shift
cd "$(dirname "$0")/../.."  # the repo root, for python -m tools.ncu
for spec in "$@"; do
  name=${spec%%:*}
  args=${spec#*:}
  # shellcheck disable=SC2086
  timeout -k 5 240 ncu --clock-control none --nvtx --nvtx-include "profile/" --set full --import-source yes \
    -f -o "$out/$name" python3 -m tools.ncu run $args > "$out/${name}_ncu.log" 2>&1 || echo "ncu $name rc=$?"
  if [ -f "$out/$name.ncu-rep" ]; then
    ncu -i "$out/$name.ncu-rep" --page details > "$out/${name}_details.txt" 2>&1
    ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_sass.csv" 2>&1
    echo "== $name: $(grep -m1 -E 'Duration' "$out/${name}_details.txt")"
  else
    tail -5 "$out/${name}_ncu.log"
  fi
done
