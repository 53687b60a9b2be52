"""The unit tier starts no Ray and no subprocess: both are refused here, so a test that needs
either fails loudly and belongs in tests/integration."""

from __future__ import annotations

import subprocess

import pytest


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"unit tests start no {what}: move this test to tests/integration")

    return refuse


@pytest.fixture(autouse=True)
def _no_subprocess_or_ray(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("subprocess"))
    import ray

    monkeypatch.setattr(ray, "init", _refuse("Ray"))


@pytest.fixture(autouse=True, scope="package")
def _prepare_in_process():
    """Prepare runs the same per-piece functions in this process (the integration and e2e tiers
    run them as Ray Data tasks): for the whole unit package, module-scoped fixtures included."""
    from app.data import pieces, prepare

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepare, "ray_tasks", lambda stall_s: pieces.InProcess())
        yield
