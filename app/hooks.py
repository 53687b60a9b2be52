"""Named points where tests inject faults and holds, in this process or in Ray's workers.

Production code calls `fire(point, **details)` at a few places (a decode-loop model call, the
start of a training epoch). Nothing is registered unless a test installs a callback: in this
process with `install(point, fn)`, or in every process that fires a point by naming modules in
$RAYTORCH_TEST_HOOKS (comma-separated; each module's `install_hooks()` runs once per process,
so a Serve replica or a Train worker that inherits the variable installs them too). A callback
raises to inject a fault or blocks to hold; its return value is ignored.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

HOOKS_ENV = "RAYTORCH_TEST_HOOKS"

_callbacks: dict[str, list[Callable[..., Any]]] = {}
_loaded = False
# Whether any callback is installed: a point fired on every decode step reads this and makes
# no call at all in production (`load_from_env` first, where the process's hooks come from).
armed = False


def install(point: str, fn: Callable[..., Any]) -> None:
    global armed
    _callbacks.setdefault(point, []).append(fn)
    armed = True


def clear() -> None:
    global armed
    _callbacks.clear()
    armed = False


def fire(point: str, **details: Any) -> None:
    load_from_env()
    for fn in _callbacks.get(point, ()):
        fn(**details)


@contextlib.contextmanager
def none_installed() -> Iterator[None]:
    """A block that runs as production does, with no hook installed (the ones before return
    after it)."""
    global armed, _loaded
    saved = _callbacks.copy(), armed, _loaded
    _callbacks.clear()
    armed, _loaded = False, True
    try:
        yield
    finally:
        _callbacks.clear()
        _callbacks.update(saved[0])
        armed, _loaded = saved[1], saved[2]


def load_from_env() -> None:
    """Installs the hooks $RAYTORCH_TEST_HOOKS names, once per process."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in filter(None, os.environ.get(HOOKS_ENV, "").split(",")):
        importlib.import_module(name.strip()).install_hooks()
