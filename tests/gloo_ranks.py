"""Ending a spawned gloo rank of a test (`torch.multiprocessing.spawn`)."""

from __future__ import annotations

import os


def leave_together() -> None:
    """A barrier, then this process ends at once. Tearing a gloo group down (by
    `destroy_process_group` or at interpreter exit) races the peer closing its side, and gloo
    then aborts the rank (SIGABRT, "terminate called without an active exception"): seen on a
    loaded machine after a barrier. Results must be written before this call."""
    import torch.distributed as dist

    dist.barrier()
    os._exit(0)
