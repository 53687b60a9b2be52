"""Connecting to Ray: a job joins RAY_ADDRESS or a running local cluster, else starts a Ray of
its own for its duration; tests and benchmarks start private ones. An address that does not
answer is found out in seconds, not after Ray's minutes of retries.
"""

from __future__ import annotations

import os
import socket
import sys

from app.errors import NoClusterError
from app.ray_private import init_local_ray

# For the Ray clusters this project starts in-process (cluster/start.sh exports the same as
# RAY_idle_worker_killing_time_threshold_ms): idle workers live 30 s instead of 1 s once a node
# runs more workers than CPUs, as every training run does, so Ray Data's task processes last
# from one epoch to the next instead of starting afresh every epoch.
LOCAL_RAY_SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 30_000}


def init_private_ray(num_cpus: int = 2) -> None:
    """A new Ray of this process's own, never a running one (tests and benchmarks): no
    dashboard, workers' output kept out of this process's."""
    init_local_ray(
        LOCAL_RAY_SYSTEM_CONFIG,
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
    )


def disconnect_ray() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def connect_ray(require_cluster: bool = False) -> None:
    """Join RAY_ADDRESS or a running local cluster; else start a local Ray for this process.

    Jobs that leave something running (deploy) pass require_cluster and fail with exit 2 instead.
    """
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or "auto"
    if address != "auto":
        check_address_answers(address)
    try:
        if address == "auto" and not local_cluster_answers():
            raise ConnectionError("no local cluster answers")
        ray.init(address=address, log_to_driver=True)
        return
    except (ConnectionError, RuntimeError) as e:
        if require_cluster:
            raise NoClusterError(
                "no running Ray cluster found "
                f"({str(e).splitlines()[0][:120]}); start one with `make cluster-up` "
                "(cluster/start.sh) or `ray start --head`, or set RAY_ADDRESS"
            ) from None
    init_local_ray(LOCAL_RAY_SYSTEM_CONFIG)


def local_cluster_answers(timeout_s: float = 1.0) -> bool:
    """Whether the cluster Ray's address file names (what address="auto" joins) is listening.

    A cluster that died without `ray stop` leaves that file behind, and joining it would wait
    on a dead GCS for half a minute before failing; a closed port answers at once.
    """
    current = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp/ray"), "ray_current_cluster")
    try:
        with open(current) as f:
            host, _, port = f.read().strip().rpartition(":")
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def check_address_answers(address: str, timeout_s: float = 3.0) -> None:
    """RAY_ADDRESS naming a cluster that is gone: one line now, not minutes of Ray's retries."""
    host, _, port = address.split("://")[-1].rstrip("/").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return
    except ValueError:
        return  # not host:port (a name Ray resolves itself): let Ray try
    except OSError as e:
        raise NoClusterError(
            f"RAY_ADDRESS={address}: nothing answers there ({e.strerror or type(e).__name__}); "
            "start that cluster (make cluster-up) or unset RAY_ADDRESS to use a local Ray"
        ) from None
