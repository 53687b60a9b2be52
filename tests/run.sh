#!/usr/bin/env bash
# Runs the suite; pytest's exit 5 ("no tests collected") counts as a failure.
#   tests/run.sh          make test: every tier without the `slow` soak runs
#   tests/run.sh --all    make test-all: the same plus the `slow` ones
#   tests/run.sh ARGS...  plain pytest arguments (one pytest run)
#
# The unit tier (no Ray, about half a minute of one core) runs beside the integration tier
# (private local Rays, mostly waiting on process start-ups), then the e2e tier (a cluster from
# cluster/start.sh on the standard ports) runs alone.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=(.venv/bin/python -m pytest --durations=${DURATIONS:-15})

check() { # a pytest exit code -> ours (5, nothing collected, is a failure)
    if [ "$1" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; return 1; fi
    return "$1"
}

if [ "$#" -gt 0 ] && [ "$1" != "--all" ]; then
    "${PYTEST[@]}" "$@"
    check $?
    exit $?
fi
MARK=(-m "not slow")
if [ "${1:-}" = "--all" ]; then MARK=(); fi

unit_log=$(mktemp)
started=$SECONDS
( "${PYTEST[@]}" "${MARK[@]}" tests/unit > "$unit_log" 2>&1; code=$?
  echo "tier unit: $((SECONDS - started)) s" >> "$unit_log"; exit $code ) &
unit_pid=$!
"${PYTEST[@]}" "${MARK[@]}" tests/integration
integration=$?
integration_s=$((SECONDS - started))
wait "$unit_pid"
unit=$?
cat "$unit_log"
rm -f "$unit_log"
echo "tier integration (beside unit): $integration_s s"
check "$unit" || { echo "unit tier failed (exit $unit)" >&2; exit 1; }
started=$SECONDS
"${PYTEST[@]}" "${MARK[@]}" tests/e2e
e2e=$?
echo "tier e2e: $((SECONDS - started)) s"
failed=0
check "$integration" || { echo "integration tier failed (exit $integration)" >&2; failed=1; }
check "$e2e" || { echo "e2e tier failed (exit $e2e)" >&2; failed=1; }
exit "$failed"
