#!/usr/bin/env bash
# Runs the suite; pytest's exit 5 ("no tests collected") counts as a failure.
#   tests/run.sh          make test: every tier without the `slow` soak runs
#   tests/run.sh --all    make test-all: the same plus the `slow` ones
#   tests/run.sh ARGS...  plain pytest arguments (one pytest run)
#
# Unit first (seconds, no Ray: a broken build fails fast). Then two lanes side by side, each its
# own pytest process: most of their wall time is waiting on Ray and Serve (process starts,
# health checks, rollouts, restarts after injected faults), not computing, and they share
# nothing: the integration tests' Rays are private (address="local", ray.cluster_utils) and e2e
# jobs name their cluster's address.
#   lane 1: the integration tier, but for the files of lane 2;
#   lane 2: the e2e tier (a cluster from cluster/start.sh on the standard ports), then the
#           fault, multi-node and tuning tests (integration, long waits).
# RAYTORCH_TEST_SERIAL=1 runs the tiers one after the other instead. Lane 2's output is printed
# when it ends; both lanes' exit codes count.
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
if [ "${RAYTORCH_TEST_SERIAL:-0}" = "1" ]; then
    "${PYTEST[@]}" "${MARK[@]}" tests/integration
    lane1=$?
    "${PYTEST[@]}" "${MARK[@]}" tests/e2e
    lane2=$?
else
    log="$(mktemp -t raytorch-lane2.XXXXXX.log)"
    # e2e first: its jobs then train while lane 1 runs its early files. When they overlapped
    # test_train.py instead, lane 1's process ended silently with exit 1 inside trainer.fit()
    # (3 runs of 6; the cause is not found yet, see docs/architecture.md "Tests").
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
