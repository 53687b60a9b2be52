"""Named points where tests inject faults and holds, in this process or in Ray's workers.

Production code calls `fire(point, **details)` at a few places (a decode-loop model call, the
start of a training epoch). Nothing is registered unless a test installs a callback: in this
process with `install(point, fn)`, or in every process that fires a point by naming modules in
$RAYTORCH_TEST_HOOKS (comma-separated; each module's `install_hooks()` runs once per process,
so a Serve replica or a Train worker that inherits the variable installs them too). A callback
raises to inject a fault or blocks to hold; its return value is ignored.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

HOOKS_ENV = "RAYTORCH_TEST_HOOKS"

_callbacks: dict[str, list[Callable[..., Any]]] = {}
_loaded = False


def install(point: str, fn: Callable[..., Any]) -> None:
    _callbacks.setdefault(point, []).append(fn)


def clear() -> None:
    _callbacks.clear()


def fire(point: str, **details: Any) -> None:
    if not _loaded:
        _load_from_env()
    for fn in _callbacks.get(point, ()):
        fn(**details)


def _load_from_env() -> None:
    global _loaded
    _loaded = True
    for name in filter(None, os.environ.get(HOOKS_ENV, "").split(",")):
        importlib.import_module(name.strip()).install_hooks()
