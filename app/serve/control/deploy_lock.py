"""One deploy at a time per cluster: a lease held by a named, detached Ray actor.

A deploy reads the whole Serve config, changes one model and submits the whole config back; two
deploys interleaving there would each submit a config without the other's model. Every deploy
(from any machine: the lock lives in the cluster, not in a local file) holds this lease across
its read-modify-write, the rollout check and a rollback. The lease expires, so a deploy killed
while holding it blocks the others for at most its TTL.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

LOCK_NAME = "raytorch-deploy-lock"
LOCK_NAMESPACE = "raytorch"


class DeployLease:
    """Who holds the lock and until when. As a Ray actor its methods run one at a time, which
    makes `acquire` an atomic test-and-set; this class itself knows nothing of Ray."""

    def __init__(self) -> None:
        self.owner: str | None = None
        self.expires = 0.0

    def acquire(self, owner: str, ttl_s: float, now: float | None = None) -> bool:
        """Take (or renew) the lease unless someone else holds an unexpired one."""
        now = time.monotonic() if now is None else now
        if self.owner not in (None, owner) and now < self.expires:
            return False
        self.owner, self.expires = owner, now + ttl_s
        return True

    def release(self, owner: str) -> bool:
        if self.owner != owner:  # expired and taken over meanwhile: not ours to free
            return False
        self.owner = None
        return True

    def holder(self) -> str | None:
        return self.owner


@contextlib.contextmanager
def hold(
    acquire: Callable[[str, float], bool],
    release: Callable[[str], Any],
    ttl_s: float,
    wait_s: float,
    poll_s: float = 1.0,
) -> Iterator[str]:
    """Poll `acquire` until it grants the lease (UserError after `wait_s`), release on exit."""
    from app.errors import UserError

    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + wait_s
    while not acquire(owner, ttl_s):
        if time.monotonic() > deadline:
            raise UserError(
                f"another deploy held the cluster's deploy lock for over {wait_s:.0f}s; retry later"
            )
        time.sleep(poll_s)
    try:
        yield owner
    finally:
        release(owner)


@contextlib.contextmanager
def cluster_lock(ttl_s: float, wait_s: float) -> Iterator[str]:
    """`hold` on the cluster's one DeployLease actor (created by whichever deploy comes first)."""
    import ray

    lease: Any = (
        ray.remote(DeployLease)
        .options(  # type: ignore[attr-defined]
            name=LOCK_NAME,
            namespace=LOCK_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
        )
        .remote()
    )
    with hold(
        lambda owner, ttl: ray.get(lease.acquire.remote(owner, ttl)),
        lambda owner: ray.get(lease.release.remote(owner)),
        ttl_s,
        wait_s,
    ) as owner:
        yield owner
