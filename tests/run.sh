#!/usr/bin/env bash
# Runs the suite; pytest's exit 5 ("no tests collected") counts as a failure.
#   tests/run.sh          make test: every tier without the `slow` soak runs
#   tests/run.sh --all    make test-all: the same plus the `slow` ones
#   tests/run.sh ARGS...  plain pytest arguments (one pytest run)
#
# Unit first (seconds, no Ray: a broken build fails fast). Then the integration tier (a private
# local Ray) and the e2e tier (a cluster from cluster/start.sh on the standard ports) run side by
# side: most of their wall time is waiting on Ray and Serve (process starts, health checks,
# rollouts), not computing, and they share nothing: the integration tier's Rays are private,
# and e2e jobs name their cluster's address. RAYTORCH_TEST_SERIAL=1 runs them one after the other.
# The e2e tier's output is printed when it ends; both tiers' exit codes count.
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

if [ "${RAYTORCH_TEST_SERIAL:-0}" = "1" ]; then
    "${PYTEST[@]}" "${MARK[@]}" tests/integration
    integration=$?
    "${PYTEST[@]}" "${MARK[@]}" tests/e2e
    e2e=$?
else
    log="$(mktemp -t raytorch-e2e.XXXXXX.log)"
    "${PYTEST[@]}" "${MARK[@]}" tests/e2e >"$log" 2>&1 &
    e2e_pid=$!
    # A run cut short (Ctrl-C, CI timeout) stops the e2e tier too; its cluster fixture tears down.
    trap 'kill -INT "$e2e_pid" 2>/dev/null; wait "$e2e_pid"; cat "$log"; exit 130' INT TERM
    "${PYTEST[@]}" "${MARK[@]}" tests/integration
    integration=$?
    wait "$e2e_pid"
    e2e=$?
    trap - INT TERM
    echo
    echo "================================ e2e tier ================================"
    cat "$log"
    rm -f "$log"
fi
failed=0
check "$integration" || { echo "integration tier failed (exit $integration)" >&2; failed=1; }
check "$e2e" || { echo "e2e tier failed (exit $e2e)" >&2; failed=1; }
exit "$failed"
