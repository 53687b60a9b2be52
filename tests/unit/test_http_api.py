"""The HTTP API's behaviour with a stand-in for the model (unit level: the real Serve path is
covered by tests/e2e/test_serve.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.config import ServeConfig
from app.ray_private import UNKNOWN_HOST, serve_http_host
from app.runtime.types import GenerationRequest, InferRequest, InferResult, ModelInfo, RequestError
from app.serve.http.api import create_api
from app.serve.http.clients import Models
from app.serve.http.gate import Gate, api_key

pytestmark = pytest.mark.unit


class _Method:
    def __init__(self, fn):
        self.fn = fn

    async def _call(self, *args):
        result = self.fn(*args)
        return await result if asyncio.iscoroutine(result) else result

    def remote(self, *args):
        return self._call(*args)


INFO = ModelInfo(
    name="m",
    version="1",
    variant="int8",
    artifact="/a",
    task="classify",
    generates=False,
    inputs=[{"name": "features", "datatype": "FP32", "shape": [-1, 2]}],
    outputs=[],
    labels=["a", "b"],
    manifest={},
    replica_pid=123,
)


class FakeModel:
    """A ModelClient answering like a classifier replica, or failing as asked."""

    def __init__(self, overloaded: bool = False, fault: str | None = None):
        self.overloaded = overloaded
        self.fault = fault
        self.infers = 0

    async def info(self) -> ModelInfo:
        return INFO

    async def infer(self, request: InferRequest) -> InferResult:
        self.infers += 1
        if self.fault == "hang":
            await asyncio.sleep(30)  # a replica that never answers in time
        if self.fault == "crash":
            raise RuntimeError("a bug, not a bad request")
        if self.fault == "died":
            from ray.exceptions import ActorDiedError

            raise ActorDiedError()
        if self.overloaded:
            from ray.serve.exceptions import BackPressureError

            raise BackPressureError(num_queued_requests=1, max_queued_requests=1)
        n = len(request.instances or []) or request.tensor.shape[0]
        return InferResult(["a"] * n, np.full((n, 2), 0.5), "1", ["a", "b"], 123)

    def generate(self, request):
        raise AssertionError("a classifier is never asked to generate")


class RayLikeMetrics:
    """Records like IngressMetrics, and refuses non-ASCII tags the way Ray's metrics do."""

    def __init__(self):
        self.seen: list[tuple[str, int]] = []

    def observe(self, model: str, code: int, latency_ms: float) -> None:
        model.encode("ascii")  # Ray: UnicodeEncodeError, which once became a plain-text 500
        self.seen.append((model, code))


def client(
    monkeypatch,
    key: str | None = None,
    overloaded: bool = False,
    fault: str | None = None,
    metrics=None,
    serve_host: str | None = None,
    **cfg,
) -> TestClient:
    if key:
        monkeypatch.setenv("RAYTORCH_API_KEY", key)
    else:
        monkeypatch.delenv("RAYTORCH_API_KEY", raising=False)
    config = ServeConfig(**cfg)
    models = Models.configured({"m": FakeModel(overloaded, fault)}, config)
    return TestClient(create_api(config, models, metrics, serve_host=serve_host))


def v2(datatype="FP32", shape=(1, 2), data=(1, 2), **extra) -> dict:
    tensor = {"name": "features", "datatype": datatype, "shape": list(shape), "data": list(data)}
    return {"inputs": [tensor], **extra}


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
    r = c.post("/v2/models/m/versions/9/infer", json=body)
    assert r.status_code == 404 and "version '9' is not deployed (live: 1)" in r.json()["error"]
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
    assert r.headers["retry-after"] == "1"


def test_a_body_of_more_values_than_the_rows_allowed_is_refused_before_it_is_parsed(monkeypatch):
    """A million empty rows (4 MiB, under the body limit) would take 380 ms to parse and 86 MiB
    of Python objects: refused from the first chunks, the parser never called, no model call."""
    import app.serve.http.gate as gate

    parsed: list[int] = []
    real = gate.json.loads
    # The json module is shared (the test client parses answers with it): count big parses.
    monkeypatch.setattr(
        gate.json, "loads", lambda b, **kw: parsed.append(len(b) > 2**20) or real(b, **kw)
    )
    c = client(monkeypatch)
    empty_rows = b'{"instances": [' + b",".join([b"[]"] * 1_000_000) + b"]}"
    r = c.post("/v1/models/m:predict", content=empty_rows)
    assert r.status_code == 413 and "JSON values" in r.json()["error"], r.text
    numbers = b",".join([b"0"] * 1_000_000)
    huge = (
        b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [999999999, 2], "data": ['
    )
    r = c.post("/v2/models/m/infer", content=huge + numbers + b"]}]}")
    assert r.status_code == 413 and "JSON values" in r.json()["error"], r.text
    assert not any(parsed)
    assert c.post("/v1/models/m:predict", json={"instances": [[1, 2]] * 1024}).status_code == 200


def test_text_rows_are_counted_after_flattening(monkeypatch):
    c = client(monkeypatch, max_request_rows=1024)
    r = c.post("/v2/models/m/infer", json=v2("BYTES", [1, 5000], ["a"] * 5000))
    assert r.status_code == 413, r.text
    assert "5000 rows exceed serve.max_request_rows=1024" in r.json()["error"]


@pytest.mark.parametrize(
    "body,field",
    [
        (v2(parameters=[1]), "parameters"),
        ({"inputs": [{**v2()["inputs"][0], "parameters": "x"}]}, "inputs[0].parameters"),
        (v2(outputs=3), "outputs"),
        (v2(outputs=[{"name": "label", "parameters": 1}]), "outputs[0].parameters"),
        ({"inputs": [{**v2("BYTES")["inputs"][0], "data": 3}]}, "inputs[0].data"),
        ({"inputs": [{**v2("BYTES")["inputs"][0], "data": None}]}, "inputs[0].data"),
        ({"inputs": [{**v2("BYTES")["inputs"][0], "data": "ab"}]}, "inputs[0].data"),
    ],
)
def test_fields_of_the_wrong_type_are_400s_naming_the_field(monkeypatch, body, field):
    r = client(monkeypatch).post("/v2/models/m/infer", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith(f"{field}: expected")


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v2/models/Z%C3%86"),
        ("GET", "/v2/models/Z%C3%86/ready"),
        ("GET", "/v2/models/Z%C3%86/versions/1/ready"),
        ("POST", "/v2/models/Z%C3%86/infer"),
        ("POST", "/v1/models/Z%C3%86:predict"),
    ],
)
def test_unknown_non_ascii_model_is_a_json_404_tagged_unknown(monkeypatch, method, path):
    metrics = RayLikeMetrics()
    c = client(monkeypatch, metrics=metrics)
    r = c.request(method, path, json={"instances": [[1, 2]]} if "predict" in path else v2())
    assert r.status_code == 404, r.text
    assert "'Z\u00c6' not found" in r.json()["error"]
    assert metrics.seen == [("unknown", 404)]  # one series for every unknown name


def test_metrics_tag_known_models_and_survive_a_failing_backend(monkeypatch):
    metrics = RayLikeMetrics()
    c = client(monkeypatch, metrics=metrics)
    assert c.post("/v2/models/m/infer", json=v2()).status_code == 200
    assert c.get("/v2/models/nope").status_code == 404
    assert c.get("/v2").status_code == 200
    assert metrics.seen == [("m", 200), ("unknown", 404), ("-", 200)]

    class Broken:
        def observe(self, *args):
            raise RuntimeError("metrics backend down")

    assert client(monkeypatch, metrics=Broken()).get("/v2/models/m").status_code == 200


def test_a_replica_that_does_not_answer_in_time_is_a_504_and_counted(monkeypatch):
    metrics = RayLikeMetrics()
    c = client(monkeypatch, fault="hang", metrics=metrics, request_timeout_s=0.2)
    start = time.monotonic()
    r = c.post("/v2/models/m/infer", json=v2())
    assert r.status_code == 504 and time.monotonic() - start < 5
    assert "serve.request_timeout_s=0.2" in r.json()["error"]
    assert metrics.seen == [("m", 504)]


def test_a_dead_replica_is_a_fast_503(monkeypatch):
    r = client(monkeypatch, fault="died").post("/v1/models/m:predict", json={"instances": [[1]]})
    assert r.status_code == 503 and "unavailable" in r.json()["error"], r.text


def test_the_key_follows_the_host_serve_really_listens_on(monkeypatch):
    monkeypatch.delenv("RAYTORCH_API_KEY", raising=False)
    assert api_key(ServeConfig(), serve_host="127.0.0.1") is None
    # serve.host says loopback, but http_options (serve.yaml, the RayService) says 0.0.0.0.
    for host in ("0.0.0.0", "10.1.2.3", UNKNOWN_HOST):
        with pytest.raises(RuntimeError, match=f"Serve listens on {host}"):
            api_key(ServeConfig(host="127.0.0.1"), serve_host=host)
    c = client(monkeypatch, key="s3cret", serve_host="0.0.0.0")
    assert c.get("/v1/models").status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_serve_http_host_reads_the_controller_and_fails_closed(monkeypatch):
    import ray

    class Options:
        host = "0.0.0.0"

    class Controller:
        get_http_config = _Method(lambda: Options())

    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: Controller())
    assert asyncio.run(serve_http_host()) == "0.0.0.0"

    def no_controller(name, namespace=None):
        raise ValueError(f"Failed to look up actor {name}")

    monkeypatch.setattr(ray, "get_actor", no_controller)
    assert asyncio.run(serve_http_host()) == UNKNOWN_HOST


def test_an_application_mounted_at_a_model_prefix_answers_the_full_routes(monkeypatch):
    # Serve mounts a model's application at /v2/models/<name>: root_path is that prefix and
    # path the full path, which the routes must still match (not the rest, `/infer`).
    metrics = RayLikeMetrics()
    api = client(monkeypatch, metrics=metrics).app
    messages: list[dict] = []

    async def call(path: str) -> int:
        body = b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}'
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "/v2/models/m",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 8000),
        }
        sent = False

        async def receive():
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            messages.append(message)

        await api(scope, receive, send)
        return next(m["status"] for m in messages if m["type"] == "http.response.start")

    assert asyncio.run(call("/v2/models/m/infer")) == 200
    messages.clear()
    assert asyncio.run(call("/v2/models/m/versions/1/infer")) == 200
    # The model's name reaches the metrics through the prefix too (it once read "-" under Serve).
    assert metrics.seen == [("m", 200), ("m", 200)]


def test_every_answer_carries_one_request_id_and_is_counted(monkeypatch):
    metrics = RayLikeMetrics()
    c = client(monkeypatch, key="s3cret", metrics=metrics, max_body_bytes=1024)
    auth = {"Authorization": "Bearer s3cret"}
    answers = [
        c.get("/v1/models"),  # 401, refused before the app
        c.post("/v1/models/m:predict", content=b"x" * 2000, headers=auth),  # 413 from the length
        c.post("/v2/models/m/infer", json=v2(), headers={**auth, "x-request-id": "abc"}),
    ]
    assert [r.status_code for r in answers] == [401, 413, 200]
    for r in answers:
        assert len(r.headers.get_list("x-request-id")) == 1, r.headers
    assert answers[2].headers["x-request-id"] == "abc"
    assert metrics.seen == [("-", 401), ("-", 413), ("m", 200)]


def test_a_crash_in_the_app_is_a_json_500_with_its_request_id(monkeypatch):
    metrics = RayLikeMetrics()
    c = TestClient(
        client(monkeypatch, fault="crash", metrics=metrics).app, raise_server_exceptions=False
    )
    r = c.post("/v2/models/m/infer", json=v2(), headers={"x-request-id": "r-1"})
    assert r.status_code == 500 and "internal error" in r.json()["error"], r.text
    assert r.headers.get_list("x-request-id") == ["r-1"]
    assert metrics.seen == [("m", 500)]


def test_completions_naming_a_classifier_is_a_400():
    """The index reaches models through handles that accept any method name; asking a
    classifier to generate must be a 400 naming it, not Serve's 500 for a missing method."""
    models = Models({"digits": FakeModel()}, timeout_s=1)
    with pytest.raises(RequestError, match="does not generate text") as info:
        asyncio.run(models.generate("digits", GenerationRequest("x", {})))
    assert info.value.status == 400


def test_request_metrics_are_summed_and_recorded_off_the_request_path():
    from app.serve.metrics import MetricBuffer

    class Recorded:
        def __init__(self):
            self.calls: list[tuple] = []

        def inc(self, value, tags):
            self.calls.append((value, tags))

        def observe(self, value, tags):
            self.calls.append((value, tags))

        set = observe

    counter, histogram, gauge = Recorded(), Recorded(), Recorded()
    buffer = MetricBuffer(interval_s=3600)  # flushed by hand here
    for code in (200, 200, 404, 200):
        buffer.inc(counter, {"model": "m", "code": str(code)})
        buffer.observe(histogram, 2.5, {"model": "m"})
        buffer.set(gauge, code, {"model": "m"})
    buffer.set(gauge, 7, {"model": "m"})
    assert counter.calls == [] and histogram.calls == []  # nothing recorded on the request path
    assert gauge.calls == []
    buffer.flush()
    assert gauge.calls == [(7, {"model": "m"})]  # a gauge's last level only
    assert sorted(counter.calls, key=str) == sorted(
        [(3, {"model": "m", "code": "200"}), (1, {"model": "m", "code": "404"})], key=str
    )
    assert histogram.calls == [(2.5, {"model": "m"})] * 4
    buffer.flush()
    assert len(counter.calls) == 2  # flushed once
    # A level that changes every step is read by the flush, once, not set per token; a
    # sampler that fails costs its own reading only.
    level = iter(range(10, 100))
    buffer.sample(lambda: buffer.set(gauge, next(level), {"model": "m"}))
    buffer.sample(lambda: 1 / 0)
    buffer.flush()
    buffer.flush()
    assert gauge.calls[-2:] == [(10, {"model": "m"}), (11, {"model": "m"})]


def test_ingress_metrics_are_kept_on_the_request_path_and_recorded_by_the_flush():
    from app.serve.http.gate import IngressMetrics
    from app.serve.metrics import MetricBuffer

    buffer = MetricBuffer(interval_s=3600)  # flushed by hand here
    metrics = IngressMetrics(buffer)
    recorded: list[tuple] = []

    class Recorded:
        def inc(self, n, tags):
            recorded.append(("n", n, tags))

        def observe(self, value, tags):
            recorded.append(("ms", value, tags))

    metrics.requests, metrics.latency = Recorded(), Recorded()
    for code, ms in ((200, 1.5), (404, 0.5), (200, 2.5)):
        metrics.observe("m", code, ms)
    assert recorded == [] and len(metrics.answered) == 3  # nothing recorded by a request
    buffer.flush()
    assert sorted(r for r in recorded if r[0] == "n") == [
        ("n", 1, {"model": "m", "code": "404"}),
        ("n", 2, {"model": "m", "code": "200"}),
    ]
    assert sorted(v for kind, v, _ in recorded if kind == "ms") == [0.5, 1.5, 2.5]
    assert len(metrics.answered) == 0


def test_a_failing_metric_record_costs_that_record_only():
    from app.serve.metrics import MetricBuffer

    class Refusing:
        def __init__(self):
            self.values: list[float] = []

        def observe(self, value, tags):
            if not tags["model"].isascii():
                raise ValueError("tag values must be ASCII")
            self.values.append(value)

    histogram = Refusing()
    buffer = MetricBuffer(interval_s=3600)
    for model, value in (("m", 1.0), ("Æ", 2.0), ("m", 3.0)):
        buffer.observe(histogram, value, {"model": model})
    buffer.flush()
    assert histogram.values == [1.0, 3.0]


def http_scope(path: str = "/x") -> dict:
    return {"type": "http", "method": "GET", "path": path, "headers": [], "root_path": ""}


class Seen:
    """Request metrics kept in a list: (status, ms) per answered request."""

    def __init__(self, seen: list):
        self.seen = seen

    def observe(self, model: str, code: int, latency_ms: float) -> None:
        self.seen.append((code, latency_ms))


def guarded(app, seen: list, key: str | None = None) -> Gate:
    return Gate(app, key=key, max_body_bytes=1024, metrics=Seen(seen))


async def no_body():
    return {"type": "http.request", "body": b"", "more_body": False}


def test_a_stream_is_timed_to_its_first_byte_and_counted_once():
    async def stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):
            await asyncio.sleep(0.1)
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    seen: list = []
    sent: list = []

    async def send(message):
        sent.append(message)

    asyncio.run(guarded(stream, seen)(http_scope(), no_body, send))
    assert [m["type"] for m in sent].count("http.response.start") == 1
    assert len(seen) == 1 and seen[0][0] == 200 and seen[0][1] < 100  # not the 300 ms stream


def test_a_crash_after_the_answer_began_is_raised_not_answered_twice():
    async def half(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("mid-stream")

    seen: list = []
    sent: list = []

    async def send(message):
        sent.append(message)

    with pytest.raises(RuntimeError, match="mid-stream"):
        asyncio.run(guarded(half, seen)(http_scope(), no_body, send))
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert [status for status, _ in seen] == [200]


def test_a_request_cancelled_before_its_answer_is_not_counted_as_an_error(monkeypatch):
    """Serve cancels the request when the client goes away; that is no 500 of ours."""
    metrics = RayLikeMetrics()
    api = client(monkeypatch, fault="hang", metrics=metrics).app
    scope = {
        **http_scope("/v1/models/m:predict"),
        "method": "POST",
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
    }

    async def receive():
        return {"type": "http.request", "body": b'{"instances": [[1, 2]]}', "more_body": False}

    async def send(message):
        raise AssertionError(f"nothing should be sent: {message}")

    async def cancelled():
        task = asyncio.ensure_future(api(scope, receive, send))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert metrics.seen == []


def test_under_serve_the_request_id_is_left_to_serves_own_middleware(monkeypatch):
    monkeypatch.delenv("RAYTORCH_API_KEY", raising=False)
    api = create_api(ServeConfig(), Models({"m": FakeModel()}, 30), under_serve=True)
    r = TestClient(api).post("/v2/models/m/infer", json=v2(), headers={"x-request-id": "abc"})
    assert r.status_code == 200 and "x-request-id" not in r.headers


def test_the_api_key_holds_under_a_model_prefix_and_other_scopes_pass_through(monkeypatch):
    seen: list = []
    inner: list = []

    async def app(scope, receive, send):
        inner.append((scope["type"], scope.get("root_path")))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

    guard = guarded(app, seen, key="s3cret")
    sent: list = []

    async def send(message):
        sent.append(message)

    prefixed = {**http_scope("/v2/models/m/infer"), "root_path": "/v2/models/m"}
    asyncio.run(guard(dict(prefixed), no_body, send))
    bearer = [(b"authorization", b"Bearer s3cret")]
    asyncio.run(guard({**prefixed, "headers": bearer}, no_body, send))
    asyncio.run(guard({"type": "lifespan", "root_path": "/v2/models/m"}, no_body, send))
    assert [status for status, _ in seen] == [401, 200]  # the refused one never reached the app
    assert inner == [("http", ""), ("lifespan", "")]


# --- reliability: no 500 for bad input, no work for a request that cannot be answered -----------


def test_an_unknown_version_is_a_404_before_any_model_runs(monkeypatch):
    c = client(monkeypatch)
    model = c.app.state.models.clients["m"]
    r = c.post("/v2/models/m/versions/7/infer", json=v2())
    assert r.status_code == 404 and model.infers == 0


def test_the_ready_probe_asks_each_model_at_most_once_a_second(monkeypatch):
    c = client(monkeypatch)
    model = c.app.state.models.clients["m"]
    calls = []
    original = model.info

    async def counted():
        calls.append(1)
        return await original()

    model.info = counted
    for _ in range(20):
        assert c.get("/v2/health/ready").status_code == 200
    assert len(calls) == 1


@pytest.mark.parametrize("key", ["bad\nkey", "lone \ud800 surrogate", "x" * 5000])
def test_an_unknown_json_key_is_a_400_that_echoes_it_safely(monkeypatch, key):
    import json

    body = json.dumps({"model": "m", "prompt": "hi", key: 1}).encode()
    r = client(monkeypatch).post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]  # OpenAI's error shape on its routes
    assert "not supported" in message and "\n" not in message and len(message) < 1000
    message.encode("utf-8")  # no lone surrogate comes back


def test_a_temperature_too_small_to_divide_by_is_greedy():
    from app.tasks.lm.http.protocol import Sampling

    def temperature(t: float) -> float:
        return Sampling(temperature=t).params(ServeConfig())["temperature"]

    for t in (1e-320, 5e-7):
        assert temperature(t) == 0.0
    assert temperature(1e-6) == 1e-6


class DyingLM(FakeModel):
    """A language model whose replica dies after the first piece."""

    async def info(self) -> ModelInfo:
        from dataclasses import replace

        return replace(INFO, task="lm", generates=True)

    async def generate(self, request):
        from ray.exceptions import ActorDiedError

        from app.runtime.types import Piece, Started

        yield Started(prompt_tokens=1, version="1")
        yield Piece("half")
        raise ActorDiedError()


def test_a_whole_completion_whose_replica_dies_is_a_503(monkeypatch):
    monkeypatch.delenv("RAYTORCH_API_KEY", raising=False)
    api = create_api(ServeConfig(), Models({"m": DyingLM()}, 5))
    r = TestClient(api).post("/v1/completions", json={"model": "m", "prompt": "hi"})
    error = r.json()["error"]
    assert r.status_code == 503 and "unavailable mid-generation" in error["message"], r.text
    assert error["type"] == "server_error"


class FailingLM(DyingLM):
    """A language model whose stream fails after its first piece, as the decode loop ends a
    stream whose model call failed (500) or found no memory (503)."""

    def __init__(self, status: int):
        super().__init__()
        self.status = status

    async def generate(self, request):
        from app.runtime.types import Piece, Started

        yield Started(prompt_tokens=1, version="1")
        yield Piece("half")
        retry = 1 if self.status == 503 else None
        raise RequestError(self.status, f"model 'm' failed ({self.status})", retry)


@pytest.mark.parametrize("status", [500, 503])
def test_a_failed_stream_is_an_error_never_a_truncated_200(monkeypatch, status):
    """Whole: OpenAI's error object with the stream's status (503 with Retry-After). Streamed:
    the chunks it had, then an error event in OpenAI's shape, then [DONE]; no finish_reason."""
    monkeypatch.delenv("RAYTORCH_API_KEY", raising=False)
    api = TestClient(create_api(ServeConfig(), Models({"m": FailingLM(status)}, 5)))
    whole = api.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert whole.status_code == status
    assert whole.json()["error"]["message"] == f"model 'm' failed ({status})"
    assert whole.json()["error"]["type"] == "server_error"
    assert (whole.headers.get("retry-after") == "1") == (status == 503)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    streamed = api.post("/v1/chat/completions", json=body)
    assert streamed.status_code == 200
    events = [e.removeprefix("data: ") for e in streamed.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == status and error["type"] == "server_error"
    chunks = [json.loads(e) for e in events[:-2]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["half"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


def test_a_v2_request_is_traceable_in_six_calls_across_three_modules(monkeypatch):
    """What the v2 route calls of the project, the request's lifecycle as a reader follows it:
    read the body (gate), decode (the route's own module), ask the model (clients), encode."""
    import sys

    import httpx

    from app.serve.http.routes import v2 as v2_routes

    api = client(monkeypatch).app
    route = v2_routes.infer.__code__
    called: set[tuple[str, str]] = set()

    def profile(frame, event, arg):
        caller = frame.f_back
        if event == "call" and caller is not None and caller.f_code is route:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("app."):
                called.add((module, frame.f_code.co_name))

    async def one_request():
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            sys.setprofile(profile)
            try:
                answer = await http.post("/v2/models/m/infer", json=v2())
            finally:
                sys.setprofile(None)
        assert answer.status_code == 200

    asyncio.run(one_request())
    assert ("app.serve.http.clients", "infer") in called and (
        "app.serve.http.routes.v2",
        "decode_v2",
    ) in called
    assert len(called) <= 6, sorted(called)
    assert len({module for module, _ in called}) <= 3, sorted(called)


def test_chat_messages_are_validated_and_refused_by_field(monkeypatch):
    from app.tasks.lm.http.serving import parse_chat

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    body = {"model": "m", "messages": [messages[0], {"role": "user", "content": parts}]}
    assert parse_chat(json.dumps(body).encode(), ServeConfig()).request.messages == tuple(messages)
    c = client(monkeypatch)
    for body, field in [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"model": "m", "messages": messages, "top_logprobs": 2}, "top_logprobs"),
        ({"model": "m", "messages": messages, "logprobs": 3}, "logprobs"),
        ({"model": "m", "messages": messages, "tools": []}, '"tools"'),
        (
            {"model": "m", "messages": messages, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
    ]:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"].startswith(f"{field}:"), error
        assert error["type"] == "invalid_request_error"


def test_n_echo_and_penalties_are_read_and_bounded():
    from app.tasks.lm.http.serving import parse_chat, parse_completion

    cfg = ServeConfig()
    body = {"model": "m", "prompt": "hi", "n": 2, "echo": True, "seed": 7, "presence_penalty": 1}
    completion = parse_completion(json.dumps(body).encode(), cfg)
    assert completion.n == 2 and completion.echo
    assert [r.params["seed"] for r in completion.requests()] == [7, 8]
    assert completion.request.params["presence_penalty"] == 1.0
    for bad_fields, named in [
        ({"n": 0}, "n"),
        ({"n": cfg.generation.max_streams + 1}, "n"),
        ({"n": 1.5}, "n"),
        ({"echo": "yes"}, "echo"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),  # the completions API takes a count
        ({"logprobs": 2}, "logprobs"),  # with echo: the prompt's logprobs are not computed
    ]:
        with pytest.raises(RequestError) as info:
            parse_completion(json.dumps({**body, **bad_fields}).encode(), cfg)
        assert info.value.message.startswith(named), info.value.message
    no_echo = {k: v for k, v in body.items() if k != "echo"}
    assert (
        parse_completion(json.dumps({**no_echo, "logprobs": 0}).encode(), cfg).request.params[
            "logprobs"
        ]
        == 0
    )
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    top = parse_chat(json.dumps({**chat, "logprobs": True, "top_logprobs": 3}).encode(), cfg)
    assert top.request.params["logprobs"] == 3 and top.request.messages == tuple(chat["messages"])
    with pytest.raises(RequestError, match="echo"):  # a completions field only
        parse_chat(json.dumps({**chat, "echo": True}).encode(), cfg)


def test_a_merged_stream_whose_client_leaves_closes_every_generation_cleanly():
    """n > 1 streamed, client gone mid-way: the route closes the merged iterator, then each
    generation; none may still be running inside the merge (aclose() would raise)."""
    from app.runtime.types import Piece
    from app.serve.http.clients import close_events
    from app.tasks.lm.http.router import merged

    closed = []

    async def generation(i: int):
        try:
            while True:
                yield Piece(str(i))
                await asyncio.sleep(0.01)
        finally:
            closed.append(i)

    async def leave_after_one_piece():
        streams = [generation(i) for i in range(3)]
        events = merged(streams)
        await events.__anext__()
        await events.aclose()
        for stream in streams:
            await close_events(stream)

    asyncio.run(leave_after_one_piece())
    assert sorted(closed) == [0, 1, 2]


def test_text_offset_counts_characters_not_the_byte_tokens_of_a_split_one():
    from app.runtime.types import Piece, TokenLogprob
    from app.tasks.lm.http.serving import CompletionEncoder

    encoder = CompletionEncoder("lm", logprobs=True)
    first, second = "é".encode()  # one character, two byte tokens that each read U+FFFD
    tokens = (
        TokenLogprob("a", (97,), -1.0),
        TokenLogprob("\ufffd", (first,), -1.0),
        TokenLogprob("\ufffd", (second,), -1.0),
        TokenLogprob("!", (33,), -1.0),
    )
    chunk = encoder.chunk(0, Piece("aé!", tokens))
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [0, 1, 1, 2]
    later = encoder.chunk(0, Piece("b", (TokenLogprob("b", (98,), -1.0),)))
    assert later["choices"][0]["logprobs"]["text_offset"] == [3]


class FakeIndex(FakeModel):
    """An index replica's thumbnails: one item with a picture, one without."""

    async def info(self) -> ModelInfo:
        return dataclasses.replace(INFO, task="index", searches=True)

    async def thumbnail(self, item: str) -> bytes:
        if item != "a/1.png":
            raise RequestError(404, f"no thumbnail for item {item!r}")
        return b"\xff\xd8jpeg"


def test_the_search_page_is_public_and_thumbnails_need_the_key(monkeypatch):
    """The page and its script hold no data: they load without the key, under a policy that
    runs no script but their own. A thumbnail is data: it needs the key, like search."""
    monkeypatch.setenv("RAYTORCH_API_KEY", "s3cret")
    config = ServeConfig()
    api = TestClient(create_api(config, Models.configured({"idx": FakeIndex()}, config)))
    page = api.get("/search")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/search.js">' in page.text
    script = api.get("/search.js")
    assert script.status_code == 200 and "textContent" in script.text
    assert "innerHTML" not in script.text and "localStorage" not in script.text
    url = "/v1/models/idx/thumbnails/a%2F1.png"  # an id with a slash, as the page encodes it
    assert api.get(url).status_code == 401
    key = {"authorization": "Bearer s3cret"}
    r = api.get(url, headers=key)
    assert r.status_code == 200 and r.content == b"\xff\xd8jpeg"
    assert r.headers["content-type"] == "image/jpeg"
    missing = api.get("/v1/models/idx/thumbnails/b.png", headers=key)
    assert missing.status_code == 404 and "no thumbnail for item 'b.png'" in missing.json()["error"]
    assert api.get("/v1/models/nope/thumbnails/a", headers=key).status_code == 404
