# Shared set-up of the GPU check scripts (sourced, not run): with ROOT and OUT set, picks the
# Python (PY, default the project's .venv), creates OUT (made absolute), moves to ROOT, sets
# the environment every step shares and starts OUT/env.txt with the run's identity; each
# script appends its own probes to env.txt. `step` runs one timed step (status=1 on failure).
if [ -z "${PY:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3 || command -v python)"; fi
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Triton's compile cache inside OUT keeps this run independent of a stale ~/.triton.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$OUT/triton-cache}"
unset TRITON_INTERPRET PIPER_KERNELS_PIN_CONFIG
{
  echo "date: $(date -Is)"; echo "host: $(hostname)"; echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo none)"
  echo "python: $PY"
} > "$OUT/env.txt" 2>&1

status=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log to OUT/NAME.log (SHOW lines shown)
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  [ $rc -eq 124 ] && echo "   timed out after ${limit}s" >> "$OUT/$name.log"
  printf '%-20s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$OUT/summary.txt"
  tail -n "${SHOW:-4}" "$OUT/$name.log" | sed 's/^/   /'
  [ $rc -eq 0 ] || status=1
}
