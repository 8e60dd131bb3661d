#!/usr/bin/env bash
# The convergence evidence (docs/CONVERGENCE.md) on one GPU machine whose calls are limited to
# 10 minutes: the arms of recipes/convergence_125m.sh (BF16, the plugin, TE blockwise, TE in BF16) train
# side by side in the background (setsid: they outlive the call that starts them; the machine stays
# up while calls follow back to back), then compare_convergence.py reads the finished runs.
#   [ONLY=plugin] bash scripts/gpu_convergence.sh start [hydra overrides...]   # TE arm only if TE imports
#   bash scripts/gpu_convergence.sh wait SECONDS                 # until all ended or SECONDS passed
#   bash scripts/gpu_convergence.sh summary                      # plot + table into $OUT/convergence
#   bash scripts/gpu_convergence.sh speed [STEPS [overrides]]    # each arm alone: uncontended tokens/s
# Runs live in $CONV_DIR (default /tmp/convergence); PYTHONPATH must already reach TE and Megatron.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR="${CONV_DIR:-/tmp/convergence}"
OUT="${OUT:-/tmp/out}"
# NAME:OVERRIDES arms (overrides joined by commas); CONV_ARMS replaces the default set, e.g.
# CONV_ARMS="te_bf16:fp8=te_bf16 sdpa_bf16:fp8=bf16,model.attention=sdpa sdpa_plugin:fp8=blockwise,model.attention=sdpa"
read -r -a ARMS <<< "${CONV_ARMS:-bf16:fp8=bf16 plugin:fp8=blockwise te:fp8=te_blockwise te_bf16:fp8=te_bf16}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

status() {
  for arm in "${ARMS[@]}"; do
    name="${arm%%:*}"; m="$DIR/$name/metrics.jsonl"
    [ -f "$DIR/$name.pid" ] || continue
    state=running; kill -0 "$(cat "$DIR/$name.pid")" 2>/dev/null || state=ended
    last="$(grep '"loss"' "$m" 2>/dev/null | grep -v event | tail -1 | cut -c1-160)"
    echo "$name [$state] ${last:-no step yet}"
    [ "$state" = ended ] && ! grep -q '"event": "end"' "$m" 2>/dev/null && tail -5 "$DIR/$name.log"
  done
}

case "${1:-}" in
  start)
    shift
    mkdir -p "$DIR"
    for arm in "${ARMS[@]}"; do
      name="${arm%%:*}"; spec="${arm#*:}"
      [ -n "${ONLY:-}" ] && [ "$name" != "$ONLY" ] && continue
      if [[ "$spec" == *fp8=te_* ]] && ! python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
        echo "$name: Transformer Engine does not import here; arm skipped"; continue
      fi
      IFS=, read -r -a args <<< "$spec"
      setsid nohup python3 -m primus_fp8_plugin.train model=gpt_125m train=convergence "${args[@]}" \
        "logging.dir=$DIR/$name" "data.cache_dir=$DIR/$name/data" logging.progress=false "$@" \
        > "$DIR/$name.log" 2>&1 < /dev/null &
      echo $! > "$DIR/$name.pid"
      echo "started $name (pid $!): ${args[*]} $*"
    done ;;
  wait)
    end=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $end ]; do
      running=0
      for f in "$DIR"/*.pid; do kill -0 "$(cat "$f")" 2>/dev/null && running=1; done
      [ $running = 0 ] && break
      sleep 10
    done
    status ;;
  status) status ;;
  summary)
    reads=()
    for arm in "${ARMS[@]}"; do
      name="${arm%%:*}"; [ -f "$DIR/$name/metrics.jsonl" ] && reads+=(--read "$name=$DIR/$name")
    done
    python3 scripts/compare_convergence.py --out "$OUT/convergence" --baseline "${BASELINE:-${ARMS[0]%%:*}}" "${reads[@]}"
    for arm in "${ARMS[@]}"; do name="${arm%%:*}"; cp "$DIR/$name/metrics.jsonl" "$OUT/convergence/$name.metrics.jsonl" 2>/dev/null; done ;;
  speed)
    # The arms above share the GPU; their tokens/s are contended. This trains each alone for a few
    # steps (same model and batch) and reports the median tokens/s after the first 10 steps.
    steps="${2:-60}"; shift; shift || true
    mkdir -p "$DIR"
    for arm in "${ARMS[@]}"; do
      name="${arm%%:*}"; spec="${arm#*:}"
      [ -n "${ONLY:-}" ] && [ "$name" != "$ONLY" ] && continue
      if [[ "$spec" == *fp8=te_* ]] && ! python3 -c "import transformer_engine.pytorch" 2>/dev/null; then continue; fi
      IFS=, read -r -a args <<< "$spec"
      d="$DIR/speed_$name"; rm -rf "$d"
      python3 -m primus_fp8_plugin.train model=gpt_125m train=convergence "${args[@]}" "train.steps=$steps" train.warmup_steps=5 \
        train.eval_interval=0 logging.log_interval=1 logging.progress=false "logging.dir=$d" "data.cache_dir=$DIR/speed_data" "$@" \
        > "$d.log" 2>&1 || { echo "$name: failed"; tail -5 "$d.log"; continue; }
      python3 - "$name" "$d/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[2])]
tps = [r["tokens_per_s"] for r in rows if "loss" in r and "event" not in r and r["step"] > 10]
print(f"{sys.argv[1]}: {statistics.median(tps):.0f} tokens/s alone (median of steps 11-{rows[-2]['step']})")
PY
    done ;;
  *) echo "usage: $0 start [overrides] | wait SECONDS | status | summary | speed [STEPS]" >&2; exit 2 ;;
esac
