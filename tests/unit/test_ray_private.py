"""Ray's private APIs live in app/ray_private.py alone, and were checked against one Ray version:
these tests fail on any other, which is the cue to check each again."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from app.ray_private import RAY_VERSION

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def test_the_installed_ray_is_the_version_the_private_calls_were_checked_against():
    import ray

    assert ray.__version__ == RAY_VERSION
    pinned = re.search(r"ray\[[a-z,]+\]==([0-9.]+)", (REPO / "pyproject.toml").read_text())
    assert pinned and pinned.group(1) == RAY_VERSION


def test_each_private_api_used_is_still_there():
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback  # noqa: F401
    from ray.train.v2._internal.callbacks.placement_group_callback import (  # noqa: F401
        PlacementGroupCleanerCallback,
    )
    from ray.train.v2._internal.execution import context, storage  # noqa: F401
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    assert SERVE_CONTROLLER_NAME and SERVE_NAMESPACE
    assert callable(ray._private.worker.get_dashboard_url)
    assert callable(TorchTrainer._create_default_callbacks)
    from ray._private.worker import init  # ray.init itself (the unit tier wraps the public name)

    assert 'kwargs.pop("_system_config"' in inspect.getsource(init)
    from ray._private.state import actors

    assert {"job_id", "actor_state_name"} <= set(inspect.signature(actors).parameters)
    from ray.serve import batching

    check = inspect.getsource(
        batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests
    )
    assert "serve.get_replica_context()" in check
    assert "_warn_if_max_batch_size_exceeds_max_ongoing_requests()" in inspect.getsource(
        batching._BatchQueue.__init__
    )


def test_no_module_but_ray_private_reaches_into_ray_internals():
    offenders = []
    for path in sorted((REPO / "app").rglob("*.py")):
        if path.name == "ray_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray"):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("ray")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_private"):
                names = [node.attr]
            elif isinstance(node, ast.keyword) and node.arg == "_system_config":
                names = [node.arg]
            if any("_internal" in n or "_private" in n or n == "_system_config" for n in names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []


def test_a_run_starts_only_the_ray_train_actors_it_needs():
    """Ray Train's DatasetManager (a process per run) is never started: each worker reads or
    streams its own share. The PlacementGroupCleaner (a detached process per run) is kept only
    for a run its job outlives (a Tune trial)."""
    import ray.train
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )

    from app.ray_private import lean_torch_trainer

    def hooks(pg_cleaner: bool = False) -> list[type]:
        trainer = lean_torch_trainer(pg_cleaner)(
            lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1)
        )
        return [type(c) for c in trainer._create_default_callbacks()]

    default = hooks()
    assert DatasetsCallback not in default and PlacementGroupCleanerCallback not in default
    assert len(default) >= 2  # the rest of Ray Train's own hooks are kept
    assert PlacementGroupCleanerCallback in hooks(pg_cleaner=True)
