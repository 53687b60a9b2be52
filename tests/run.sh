#!/usr/bin/env bash
# Runs the suite; pytest's exit 5 ("no tests collected") counts as a failure.
#   tests/run.sh          make test: every tier without the `slow` soak runs
#   tests/run.sh --all    make test-all: the same plus the `slow` ones
#   tests/run.sh ARGS...  plain pytest arguments (one pytest run)
#
# The tiers run side by side in three lanes, each line of output prefixed with its tier:
#   unit          no Ray;
#   integration   private local Rays on random ports;
#   e2e           the cluster cluster/start.sh starts, on the standard ports, and then
#                 integration-late, the integration modules in LATE.
# The box is CPU-bound with the lanes side by side, so LATE (modules that share no costly session
# fixture with the rest: their own clusters, or data prepared in seconds) evens out the two long
# lanes. The integration lane starts once the e2e cluster holds its ports (or the e2e tier has
# ended): a private Ray takes Ray's fixed dashboard-agent port (52365) when it is free, and the
# e2e cluster's Jobs API needs it. Each tier runs in a session of its own, so a signal sent to
# one tier's process group never reaches another's; Ctrl-C stops them all.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=(.venv/bin/python -m pytest --durations=${DURATIONS:-15})
# Idle OpenMP threads sleep instead of spinning: with the tiers side by side every core is
# taken, and a thread spinning at the end of each parallel region burns what another tier needs
# (one clean-clone run: 12:53 spinning, 11:54 passive).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

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

state=$(mktemp -d)
signal_tiers() {
    for leader in "$state"/*.pgid; do
        [ -e "$leader" ] && kill "-$1" -- "-$(cat "$leader")" 2>/dev/null
    done
}
stop_tiers() { # pytest may sit out one SIGINT inside a Ray call
    touch "$state/stopped"  # no lane starts its next tier
    signal_tiers INT
    sleep 10
    signal_tiers KILL
}
# The e2e tier's cluster records itself here (cluster/start.sh), so that an interrupted run stops
# that cluster, and only that one, even when its pytest was killed before its own teardown.
e2e_cluster="$state/e2e-cluster.state"
stop_e2e_cluster() {
    [ -e "$e2e_cluster" ] || return 0
    RAYTORCH_CLUSTER_STATE="$e2e_cluster" RAYTORCH_STOP_GRACE_S=0 bash cluster/stop.sh >/dev/null ||
        echo "the e2e tier's cluster did not stop: make cluster-down FORCE=1" >&2
}
trap 'stop_tiers; wait; stop_e2e_cluster; rm -rf "$state"; exit 130' INT TERM

LATE=(tests/integration/test_elastic.py tests/integration/test_prepare_nodes.py
    tests/integration/test_faults.py tests/integration/test_fsdp.py)

tier() { # NAME PATH...: one pytest in its own session; its exit code and time in $state
    local name=$1 started=$SECONDS
    shift
    setsid bash -c 'echo $$ > "$0.pgid"; exec "$@"' "$state/$name" \
        "${PYTEST[@]}" "${MARK[@]}" "$@" 2>&1 | sed -u "s/^/$name | /"
    echo "${PIPESTATUS[0]}" > "$state/$name.code"
    echo "tier $name: $((SECONDS - started)) s" | tee "$state/$name.time"
}

e2e_cluster_up() { # Ray's dashboard-agent port answers, or the e2e tier is over
    (exec 3<>/dev/tcp/127.0.0.1/52365) 2>/dev/null || [ -e "$state/e2e.code" ]
}

tiers=(unit integration e2e integration-late)
{
    RAYTORCH_CLUSTER_STATE="$e2e_cluster" tier e2e tests/e2e
    [ -e "$state/stopped" ] || tier integration-late "${LATE[@]}"
} &
tier unit tests/unit &
for _ in $(seq 240); do e2e_cluster_up && break; sleep 1; done
tier integration tests/integration "${LATE[@]/#/--ignore=}" &
wait
stop_e2e_cluster # left only when the e2e tier's own teardown could not stop it
failed=0
for name in "${tiers[@]}"; do
    cat "$state/$name.time"
    code=$(cat "$state/$name.code")
    check "$code" || { echo "$name tier failed (exit $code)" >&2; failed=1; }
done
rm -rf "$state"
exit "$failed"
