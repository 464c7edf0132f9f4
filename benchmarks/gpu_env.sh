# Shared set-up of the GPU check scripts (sourced, not run): with ROOT and OUT set, picks the
# Python (PY, default the project's .venv), creates OUT (made absolute), moves to ROOT, sets
# the environment every step shares and starts OUT/env.txt with the run's identity; each
# script appends its own probes to env.txt. `step` runs one timed step (status=1 on failure).
#
# Two settings for a machine lent for minutes (a device call's command may run 10 minutes and
# bring back at most 8 files):
#   GPU_CHECK_BUDGET_S  the whole check's seconds (0: none). Every step gets at most what is
#                       left of it (less STEP_GRACE_S, the kill grace of `timeout`), and a step
#                       with less than MIN_STEP_S left is not started: its summary row says
#                       "skipped", and the check fails. The scripts run their steps most
#                       important first, so a short budget drops the benchmarks, not the tests.
#   GPU_CHECK_ARCHIVE   a .tar.gz path: on exit, whatever the exit status, OUT (without the
#                       Triton compile cache and the runs' checkpoints) is packed into it and
#                       summary.txt copied beside it.
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
  echo "budget: ${GPU_CHECK_BUDGET_S:-0} s"
} > "$OUT/env.txt" 2>&1

GPU_CHECK_BUDGET_S="${GPU_CHECK_BUDGET_S:-0}"
STEP_GRACE_S=20  # `timeout --kill-after=15` plus the step's own start and logging
MIN_STEP_S=30
case "$GPU_CHECK_BUDGET_S" in
  ''|*[!0-9]*) echo "GPU_CHECK_BUDGET_S=$GPU_CHECK_BUDGET_S: expected whole seconds (0: no budget)" >&2; exit 64 ;;
esac
if [ -n "${GPU_CHECK_ARCHIVE:-}" ]; then
  case "$GPU_CHECK_ARCHIVE" in
    *.tar.gz|*.tgz) ;;
    *) echo "GPU_CHECK_ARCHIVE=$GPU_CHECK_ARCHIVE: expected a path ending in .tar.gz or .tgz" >&2; exit 64 ;;
  esac
  mkdir -p "$(dirname "$GPU_CHECK_ARCHIVE")" || exit 64
  GPU_CHECK_ARCHIVE="$(cd "$(dirname "$GPU_CHECK_ARCHIVE")" && pwd)/$(basename "$GPU_CHECK_ARCHIVE")"
  case "$GPU_CHECK_ARCHIVE" in
    "$OUT"/*) echo "GPU_CHECK_ARCHIVE=$GPU_CHECK_ARCHIVE lies inside OUT ($OUT), which it packs: put it elsewhere" >&2; exit 64 ;;
  esac
fi
START_S=$SECONDS
pack_results() {  # the EXIT trap: OUT into GPU_CHECK_ARCHIVE (if set), summary.txt beside it
  local rc=$?
  if [ -n "${GPU_CHECK_ARCHIVE:-}" ]; then
    # without the compile cache and the runs' checkpoints (~40 MB each for the tiny model)
    tar -czf "$GPU_CHECK_ARCHIVE" --exclude="$(basename "$OUT")/triton-cache" \
      --exclude="$(basename "$OUT")/*/checkpoints" -C "$(dirname "$OUT")" "$(basename "$OUT")" \
      && cp "$OUT/summary.txt" "$(dirname "$GPU_CHECK_ARCHIVE")/summary.txt" 2>/dev/null
    local kib
    kib=$(du -k "$GPU_CHECK_ARCHIVE" | cut -f1)
    echo "packed $OUT into $GPU_CHECK_ARCHIVE (${kib} KiB)"
    [ "$kib" -le 16384 ] || echo "warning: the archive is over 16 MiB, what one file brought back from a lent machine may be" >&2
  fi
  return $rc
}
trap pack_results EXIT

status=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log to OUT/NAME.log (SHOW lines shown)
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS rc left
  if [ "$GPU_CHECK_BUDGET_S" -gt 0 ]; then
    left=$((GPU_CHECK_BUDGET_S - (SECONDS - START_S) - STEP_GRACE_S))
    if [ "$left" -lt "$MIN_STEP_S" ]; then
      printf '%-20s rc=%-3s %4ss  skipped: %ss budget spent\n' "$name" "-" 0 "$GPU_CHECK_BUDGET_S" \
        | tee -a "$OUT/summary.txt"
      status=1
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  [ $rc -eq 124 ] && echo "   timed out after ${limit}s" >> "$OUT/$name.log"
  printf '%-20s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$OUT/summary.txt"
  tail -n "${SHOW:-4}" "$OUT/$name.log" | sed 's/^/   /'
  [ $rc -eq 0 ] || status=1
}

# require_modules MOD...: exit 3 (before any step) naming the modules $PY cannot import, so a
# machine without them loses seconds, not its lease.
require_modules() {
  local missing
  missing="$("$PY" - "$@" <<'PYEOF'
import importlib, sys
bad = []
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as e:  # an ImportError, or a package that breaks on import
        bad.append(f"{m} ({type(e).__name__}: {e})")
print("; ".join(bad))
PYEOF
)" || missing="the interpreter itself failed"
  if [ -n "$missing" ]; then
    echo "gpu check: $PY cannot import: $missing. Install them into that Python, or set PY to one that has them (docs/benchmarks.md, 'The GPU checks')" \
      | tee "$OUT/summary.txt" >&2
    exit 3
  fi
}
