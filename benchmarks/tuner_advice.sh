#!/usr/bin/env bash
# DeepSeek-V3 on 1024 Frontier GCDs and 1024 H100: the planner's pick and the TP / ZeRO-3
# layouts it is compared with (docs/planner.md, "the advice with the new model"). Analytic,
# nothing is timed; ~4 minutes on 2 cores. Results under OUT_DIR (default runs/tuner_advice):
# plan_<platform>.log (the search's table) and estimate_<platform>.jsonl (one JSON per row).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT_DIR=${OUT_DIR:-runs/tuner_advice}
mkdir -p "$OUT_DIR"
COMMON=(--model deepseek-v3 --gpus 1024 --seq 4096 --global-batch 4096)
ROWS=(
  "--pp 32 --ep 4 --zero 2 --schedule zb-h1"
  "--pp 32 --ep 8 --zero 2 --schedule zb-h1"
  "--pp 32 --ep 8 --tp 2 --zero 2 --schedule zb-h1"
  "--pp 16 --ep 8 --tp 8 --zero 1"
  "--pp 8 --vpp 4 --ep 64 --tp 2 --zero 1"
  "--pp 8 --ep 32 --tp 4 --zero 1"
  "--pp 16 --ep 64 --tp 2 --zero 1"
  "--pp 4 --vpp 8 --ep 64 --zero 3"
  "--pp 1 --ep 64 --zero 3"
  "--pp 4 --ep 64 --zero 3"
  "--pp 8 --ep 32 --zero 3"
  "--pp 32 --ep 8 --zero 3"
  # the same with dedup and the layer pipeline (the planner's own pick runs them; TP and
  # ZeRO-3 layouts priced with them too, reported not runnable where train.py lacks them)
  "--pp 32 --ep 16 --zero 2 --schedule zb-h1 --dispatch dedup --a2a-overlap layer"
  "--pp 32 --ep 8 --tp 2 --zero 2 --schedule zb-h1 --dispatch dedup --a2a-overlap layer"
  "--pp 4 --vpp 8 --ep 64 --zero 3 --dispatch dedup --a2a-overlap layer"
  "--pp 8 --ep 32 --tp 4 --zero 1 --dispatch dedup --a2a-overlap layer"
)
for plat in frontier dgx-h100; do
  echo "[advice] $plat: tuner plan (every point of the space, ZeRO 0-3: ~1-2 minutes)"
  "$PY" -m tuner plan "${COMMON[@]}" --platform "$plat" --out "$OUT_DIR/plans_$plat" \
    > "$OUT_DIR/plan_$plat.log"
  grep -E "^ +1 |^best:" "$OUT_DIR/plan_$plat.log"
  : > "$OUT_DIR/estimate_$plat.jsonl"
  for flags in "${ROWS[@]}"; do
    # shellcheck disable=SC2086  # the row's flags are split on purpose
    line=$("$PY" -m tuner estimate "${COMMON[@]}" --platform "$plat" --recompute full $flags --json | tail -1)
    echo "$line" >> "$OUT_DIR/estimate_$plat.jsonl"
    "$PY" -c 'import json, sys; d = json.loads(sys.argv[2]); print("  %-48s step %8.2f s  MFU %5.1f %%  peak %5.1f GB  runnable %s" % (sys.argv[1], d["step_time_s"], 100 * d["mfu"], d["peak_memory_gb"], d["runnable"]))' "$flags" "$line"
  done
done
