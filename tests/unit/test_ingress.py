"""The ingress's HTTP behaviour with a stand-in for the model deployment (unit level: the real
Serve path is covered by tests/e2e/test_serve.py)."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.config import ServeConfig
from app.serve.ingress import ModelRouter, api_key, create_api

pytestmark = pytest.mark.unit


class _Method:
    def __init__(self, fn):
        self.fn = fn

    async def _call(self, *args):
        return self.fn(*args)

    def remote(self, *args):
        return self._call(*args)


class FakeModel:
    """Answers like ModelServer: metadata() and infer() results as plain dicts."""

    def __init__(self, overloaded: bool = False):
        self.overloaded = overloaded
        self.metadata = _Method(
            lambda: {
                "name": "m",
                "version": "1",
                "variant": "int8",
                "artifact": "/a",
                "manifest": {},
                "schema": {
                    "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 2]}],
                    "outputs": [],
                    "labels": ["a", "b"],
                },
            }
        )
        self.infer = _Method(self._infer)

    def _infer(self, payload):
        if self.overloaded:
            from ray.serve.exceptions import BackPressureError

            raise BackPressureError(num_queued_requests=1, max_queued_requests=1)
        n = len(payload.get("instances") or []) or payload["tensor"]["shape"][0]
        return {
            "labels": ["a"] * n,
            "probabilities": np.full((n, 2), 0.5).tolist(),
            "version": "1",
            "label_names": ["a", "b"],
            "replica_pid": 123,
        }


def client(monkeypatch, key: str | None = None, overloaded: bool = False, **cfg) -> TestClient:
    if key:
        monkeypatch.setenv("RAYTORCH_API_KEY", key)
    else:
        monkeypatch.delenv("RAYTORCH_API_KEY", raising=False)
    return TestClient(create_api(ServeConfig(**cfg), ModelRouter({"m": FakeModel(overloaded)})))


def test_v1_and_v2_answers(monkeypatch):
    c = client(monkeypatch)
    r = c.post("/v1/models/m:predict", json={"instances": [[1, 2]]})
    assert r.status_code == 200 and r.json()["predictions"][0]["probabilities"] == {
        "a": 0.5,
        "b": 0.5,
    }
    body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    r = c.post("/v2/models/m/infer", json=body)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == ["a"]
    assert r.headers["x-request-id"] and r.headers["x-model-replica"] == "123"
    assert c.post("/v2/models/m/versions/9/infer", json=body).status_code == 404
    assert c.get("/v2/models/m").json()["versions"] == ["1"]


def test_api_key(monkeypatch):
    c = client(monkeypatch, key="s3cret")
    assert c.get("/v2/health/live").status_code == 200  # probes stay open
    assert c.get("/v1/models").status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_public_bind_needs_a_key(monkeypatch):
    monkeypatch.delenv("RAYTORCH_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="RAYTORCH_API_KEY"):
        api_key(ServeConfig(host="0.0.0.0"))


def test_limits_errors_and_overload(monkeypatch):
    c = client(monkeypatch, max_body_bytes=1024, max_request_rows=2)
    assert c.post("/v1/models/m:predict", content=b"[" + b"0," * 2000 + b"0]").status_code == 413
    r = c.post("/v1/models/m:predict", json={"instances": [[1, 2]] * 3})
    assert r.status_code == 413 and "max_request_rows" in r.json()["error"]
    r = c.post("/v1/models/zz:predict", json={"instances": [[1, 2]]})
    assert r.status_code == 404 and "zz" in r.json()["error"]
    assert c.get("/nowhere").json() == {"error": "no route /nowhere"}
    overloaded = client(monkeypatch, overloaded=True)
    r = overloaded.post("/v1/models/m:predict", json={"instances": [[1, 2]]})
    assert r.status_code == 503 and "overloaded" in r.json()["error"]
