"""Faults and holds the tests inject (app/hooks.py): into the decode loop, keyed by a request's
`seed`, so one stream among many is the faulty one; into training, by markers in a run's folder. Installed in a process by naming this module in
$RAYTORCH_TEST_HOOKS (tests/integration/conftest.py does, before its Ray starts, so Serve
replicas install it too), or in-process with `install_hooks()`.

- FAIL_SEED: every model call once the stream has two tokens raises (its prompt fills and it
  takes a step, then its steps fail, batched and alone): an ONNX Runtime failure mid-stream.
- FAIL_AT_ONCE_SEED: every model call that includes the stream raises (its prompt never fills).
- MEMORY_SEED: joining the batch raises MemoryError.
- WEDGE_SEED: the call never returns (until `RELEASE` is set): a wedged decode thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from app import hooks, storage

FAIL_SEED = 990_001
FAIL_AT_ONCE_SEED = 990_002
MEMORY_SEED = 990_003
WEDGE_SEED = 990_004
RELEASE = threading.Event()


class InjectedFault(RuntimeError):
    pass


def _seed(stream: Any) -> int | None:
    return stream.decoding.params.seed


def decode_call(streams: list[Any]) -> None:
    for stream in streams:
        seed = _seed(stream)
        if seed == FAIL_AT_ONCE_SEED or (seed == FAIL_SEED and stream.completion_tokens >= 2):
            raise InjectedFault("injected: the model call failed")
        if seed == WEDGE_SEED:
            RELEASE.wait()


def decode_join(streams: list[Any]) -> None:
    if any(_seed(stream) == MEMORY_SEED for stream in streams):
        raise MemoryError("injected: no memory for the wider batch")


def install_hooks() -> None:
    hooks.install("decode.call", decode_call)
    hooks.install("decode.join", decode_join)
    hooks.install("train.epoch", train_epoch)


# --- training ------------------------------------------------------------------------------------
# At the start of every epoch, each rank fails once where `fail_at` left a marker, and waits
# while `hold` has one (rank 0 saying so first), so a test can change the cluster at a known
# point of a run. The markers live in the run's folder: they reach every node the run does.


def fail_at(run_dir: str, rank: int, epoch: int) -> None:
    """`rank` raises once at the start of `epoch` of the run at `run_dir`."""
    storage.write_bytes(storage.join(run_dir, f"fail-rank{rank}-epoch{epoch}"), b"")


def hold(run_dir: str, epoch: int) -> None:
    storage.write_bytes(storage.join(run_dir, f"hold-epoch-{epoch}"), b"")


def release(run_dir: str, epoch: int) -> None:
    storage.delete_file(storage.join(run_dir, f"hold-epoch-{epoch}"))


def held(run_dir: str, epoch: int, world: int) -> bool:
    """Whether the run waits at `epoch` with `world` ranks."""
    return storage.exists(storage.join(run_dir, f"held-epoch-{epoch}-world-{world}"))


def train_epoch(run_dir: str, rank: int, world: int, epoch: int) -> None:
    fault = storage.join(run_dir, f"fail-rank{rank}-epoch{epoch}")
    if storage.exists(fault):
        storage.delete_file(fault)
        raise InjectedFault(f"injected fault: rank {rank} at epoch {epoch}")
    waiting = storage.join(run_dir, f"hold-epoch-{epoch}")
    if rank == 0 and storage.exists(waiting):
        storage.write_bytes(storage.join(run_dir, f"held-epoch-{epoch}-world-{world}"), b"")
    while storage.exists(waiting):
        time.sleep(0.2)
