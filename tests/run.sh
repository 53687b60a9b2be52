#!/usr/bin/env bash
# Runs the suite; pytest's exit 5 ("no tests collected") counts as a failure.
#   tests/run.sh          make test: every tier without the `slow` soak runs
#   tests/run.sh --all    make test-all: the same plus the `slow` ones
#   tests/run.sh ARGS...  plain pytest arguments (one pytest run)
#
# Unit first (seconds, no Ray: a broken build fails fast), then the integration tier (private
# local Rays), then the e2e tier (a cluster from cluster/start.sh on the standard ports).
#
# RAYTORCH_TEST_PARALLEL=1 (experimental) runs two lanes side by side instead: lane 1 the
# integration tier, lane 2 the e2e tier and then the fault, multi-node and tuning files. Most of
# their time is waiting on Ray and Serve (measured before the memory data path: about 12 minutes instead of 13),
# but in 4 of 7 runs lane 1's pytest ended silently (exit 1) in test_train.py while lane 2 was
# training or injecting faults, its Ray reporting lost objects first: the cause is not found, so
# it is not the default. Lane 2's output is printed when it ends; both lanes' exit codes count.
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

LANE2=(tests/integration/test_faults.py tests/integration/test_multinode.py
    tests/integration/test_tune.py)
if [ "${RAYTORCH_TEST_PARALLEL:-0}" != "1" ]; then
    "${PYTEST[@]}" "${MARK[@]}" tests/integration
    lane1=$?
    "${PYTEST[@]}" "${MARK[@]}" tests/e2e
    lane2=$?
else
    log="$(mktemp -t raytorch-lane2.XXXXXX.log)"
    "${PYTEST[@]}" "${MARK[@]}" tests/e2e "${LANE2[@]}" >"$log" 2>&1 &
    lane2_pid=$!
    # A run cut short (Ctrl-C, CI timeout) stops lane 2 too; its cluster fixture tears down.
    trap 'kill -INT "$lane2_pid" 2>/dev/null; wait "$lane2_pid"; cat "$log"; exit 130' INT TERM
    ignore=()
    for f in "${LANE2[@]}"; do ignore+=("--ignore=$f"); done
    "${PYTEST[@]}" "${MARK[@]}" "${ignore[@]}" tests/integration
    lane1=$?
    wait "$lane2_pid"
    lane2=$?
    trap - INT TERM
    echo
    echo "============== lane 2: e2e, then faults, multi-node, tuning =============="
    cat "$log"
    rm -f "$log"
fi
failed=0
check "$lane1" || { echo "lane 1 (integration) failed (exit $lane1)" >&2; failed=1; }
check "$lane2" || { echo "lane 2 (faults, multi-node, tuning, e2e) failed (exit $lane2)" >&2; failed=1; }
exit "$failed"
