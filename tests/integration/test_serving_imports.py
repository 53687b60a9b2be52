"""A model's replica builds its HTTP app from the shared routes and the built-in tasks' routers
alone: it loads no task spec (which imports every stage), so no torch, no export, no training,
and a replica of an ONNX model stays small. The other way round, a training rank unpickles only the
parts of its task it calls, so no Serve, no HTTP layer and no exporter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

BUILD_THE_APP = """
import json, sys
from app.config import ServeConfig
from app.serve.http.api import create_api
from app.serve.http.clients import Models
from app.serve.replicas.apps import own_task_routes
own_task_routes({"task": "classify"})
api = create_api(ServeConfig(), Models({}, 5))
from app.registry import looked_up
heavy = ("torch", "app.export", "app.train", "app.evaluate", "app.pipeline")
print(json.dumps({
    "tasks": [t.name for t in looked_up()],
    "paths": sorted(r.path for r in api.routes),
    "heavy": sorted(m for m in sys.modules if m.startswith(heavy) or m.endswith(".task")),
}))
"""


def test_a_replicas_http_app_loads_no_task_spec_nor_torch():
    out = subprocess.run(
        [sys.executable, "-c", BUILD_THE_APP], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    built = json.loads(out.stdout.strip().splitlines()[-1])
    assert built["heavy"] == []
    assert built["tasks"] == []  # the registry's built-ins were never loaded
    # Every built-in task's routes are there all the same.
    for path in ("/v1/completions", "/v1/embeddings", "/v1/models/{name}:search", "/search"):
        assert path in built["paths"]


UNPICKLE_THE_TASKS = """
import json, sys
from ray import cloudpickle
tasks = [cloudpickle.loads(bytes.fromhex(line)) for line in sys.stdin.read().split()]
serving = ("ray.serve", "app.serve", "fastapi", "starlette", "app.export", "app.predict")
print(json.dumps({
    "parts": [sorted(t.parts) for t in tasks],
    "serving": sorted(m for m in sys.modules if m.startswith(serving)),
}))
"""


def test_a_training_rank_unpickles_no_serving_part_of_its_task():
    """Ray Train's ranks and controller unpickle the task the driver hands them: with only the
    parts a rank calls, none of them imports Ray Serve, the HTTP layer or the exporter."""
    from ray import cloudpickle

    from app.registry import task_named
    from app.train.worker import RANK_PARTS, rank_task

    tasks = [rank_task(task_named(name)) for name in ("classify", "lm", "retrieval")]
    out = subprocess.run(
        [sys.executable, "-c", UNPICKLE_THE_TASKS],
        input=" ".join(cloudpickle.dumps(t).hex() for t in tasks),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["serving"] == []
    wanted = {part.name for part in RANK_PARTS}
    assert all(
        set(parts) <= wanted and {"loss", "validate"} <= set(parts) for parts in loaded["parts"]
    )
