"""Faults the tests inject into the decode loop (app/hooks.py), keyed by a request's `seed`, so
one stream among many is the faulty one. Installed in a process by naming this module in
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
from typing import Any

from app import hooks

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
