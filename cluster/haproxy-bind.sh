#!/usr/bin/env bash
# HAProxy as Ray Serve starts it, with its stats and Prometheus listeners on RAYTORCH_BIND_HOST
# instead of every interface: Ray 2.60's HAProxy template binds them to `*` and has no setting
# for the host. cluster/start.sh points RAY_SERVE_HAPROXY_BINARY_PATH here and
# RAYTORCH_HAPROXY_BINARY at the real binary; every start and reload passes `-f CONFIG`.
set -euo pipefail
real="${RAYTORCH_HAPROXY_BINARY:?RAYTORCH_HAPROXY_BINARY names the real haproxy}"
host="${RAYTORCH_BIND_HOST:-127.0.0.1}"
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; i++)); do
    if [[ "${args[i]}" == "-f" && -f "${args[i + 1]}" ]]; then
        # `bind *:8404` and `bind :9101`; the HTTP frontend's `bind HOST:PORT` is left alone.
        sed -i -E "s/^([[:space:]]*)bind (\*)?:([0-9]+)[[:space:]]*$/\1bind ${host}:\3/" "${args[i + 1]}"
    fi
done
exec "$real" "$@"
