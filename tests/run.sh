#!/usr/bin/env bash
# Runs the suite; pytest's exit 5 ("no tests collected") counts as a failure.
#   tests/run.sh          make test: every tier without the `slow` soak runs
#   tests/run.sh --all    make test-all: the same plus the `slow` ones
#   tests/run.sh ARGS...  plain pytest arguments (one pytest run)
#
# Unit first (seconds, no Ray: a broken build fails fast), then the integration tier (private
# local Rays), then the e2e tier (a cluster from cluster/start.sh on the standard ports).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=(.venv/bin/python -m pytest --durations=15)

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

"${PYTEST[@]}" "${MARK[@]}" tests/unit || { check $?; exit 1; }

"${PYTEST[@]}" "${MARK[@]}" tests/integration
integration=$?
"${PYTEST[@]}" "${MARK[@]}" tests/e2e
e2e=$?
failed=0
check "$integration" || { echo "integration tier failed (exit $integration)" >&2; failed=1; }
check "$e2e" || { echo "e2e tier failed (exit $e2e)" >&2; failed=1; }
exit "$failed"
