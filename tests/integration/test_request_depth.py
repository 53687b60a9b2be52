"""How deep a request goes: a v2 inference traced through the in-process app (the HTTP stack and
the replica of a real exported model, as a Serve replica runs them) with a profiler on every
thread, counting the project functions it enters. Comprehensions, generator expressions and
dataclass-made `__init__`s are expressions, not places a reader has to go, and are not counted;
neither is the metrics flush thread, which runs once a second beside every request."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections import Counter
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.integration

MAX_FUNCTIONS = 25
# One module per stage: the gate (middleware, metrics, the body read), the v2 route and its
# wire format, the models directory, the replica, the row checks and probabilities, the kind's
# preprocessor.
MAX_MODULES = 6


def counted(frame) -> tuple[str, str] | None:
    module = frame.f_globals.get("__name__", "")
    code = frame.f_code
    if not module.startswith("app.") or "<" in code.co_name or "__create_fn__" in code.co_qualname:
        return None
    if threading.current_thread().name == "metric-flush":
        return None
    return module, code.co_qualname


@contextlib.contextmanager
def tracing() -> Iterator[tuple[Counter[tuple[str, str]], threading.Event]]:
    """A profiler on this thread and every thread started inside the block (enter it before
    the app's pools and loops start): (module, function) -> calls, counted while the event is
    set."""
    entered: Counter[tuple[str, str]] = Counter()
    recording = threading.Event()

    def profile(frame, event, arg):
        if event == "call" and recording.is_set() and (where := counted(frame)) is not None:
            entered[where] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield entered, recording
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def test_a_v2_request_enters_few_project_functions_over_few_modules(exported):
    from app.config import ServeConfig
    from app.serve.http.api import create_api
    from app.serve.http.clients import LocalModel, Models
    from app.serve.http.gate import IngressMetrics
    from app.tasks.classify.replica import ClassifierServer

    config, result = exported("digits")
    with tracing() as (entered, recording):  # before the replica's pools start their threads
        cfg = ServeConfig()
        server = ClassifierServer(result["artifact"], cfg)
        api = create_api(
            cfg, Models.configured({"digits": LocalModel(server)}, cfg), IngressMetrics()
        )
        body = {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [1, 64],
                    "data": list(np.arange(64.0)),
                }
            ]
        }

        async def requests():
            transport = httpx.ASGITransport(app=api)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                for _ in range(3):  # warm: the first request reads the model's info
                    assert (
                        await http.post("/v2/models/digits/infer", json=body)
                    ).status_code == 200
                recording.set()
                answer = await http.post("/v2/models/digits/infer", json=body)
                recording.clear()
                assert answer.status_code == 200, answer.text

        asyncio.run(requests())
    modules = sorted({module for module, _ in entered})
    listing = "\n".join(f"{m}:{f}" for m, f in sorted(entered))
    assert len(entered) <= MAX_FUNCTIONS, f"{len(entered)} functions:\n{listing}"
    assert len(modules) <= MAX_MODULES, f"{len(modules)} modules: {modules}"
