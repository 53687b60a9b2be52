"""Serving end to end: real cluster, real Serve, real HTTP on 127.0.0.1.

The README chain's digits model, exported twice (versions 1 and 2 of the same weights) and deployed
with the jobs; the tests then check answers against the artifact run offline, bad input, the
Triton client, autoscaling, a killed replica, a rolling update and a rollback under load.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import requests

from app.runtime.artifact import open_artifact, run_logits
from tests.conftest import REPO
from tests.e2e.conftest import (
    API_KEY_HEADER,
    SERVE,
    TEST_API_KEY,
    TEST_API_KEY_ENV,
    ClosedLoop,
    get_json,
    run_job,
    wait_for,
)

pytestmark = pytest.mark.e2e
JSON = {"Content-Type": "application/json"}
AUTHORIZED = {**JSON, **API_KEY_HEADER}
# Short autoscaling delays so scaling happens within the test's patience.
SERVE_OVERRIDES = [
    "serve.autoscaling.min_replicas=1",
    "serve.autoscaling.max_replicas=2",
    "serve.autoscaling.target_ongoing_requests=1",
    "serve.autoscaling.upscale_delay_s=1",
    "serve.autoscaling.downscale_delay_s=4",
    "serve.autoscaling.look_back_period_s=2",
    "serve.autoscaling.metrics_interval_s=0.5",
    "serve.batching.max_batch_size=4",
    "serve.max_ongoing_requests=4",
    "serve.health_check_period_s=2",
]


@pytest.fixture(scope="module")
def served(readme_chain):
    """The README chain's digits model (tests/e2e/conftest.py: trained, exported as version 1
    and deployed by the README's commands), exported again as version 2 of the same weights,
    and version 1 deployed again with short autoscaling delays."""
    root = readme_chain["root"] / "outputs"
    base = [
        f"--config={REPO / 'configs/digits.yaml'}",
        f"data.output={root}/data/digits",
        f"train.storage_path={root}/runs",
        f"export.registry={root}/registry",
    ]
    ckpt = readme_chain["train"]["checkpoint"]
    v1 = readme_chain["export"]["artifact"]
    v2 = run_job("export", *base, f"--checkpoint={ckpt}")["artifact"]
    deploy_args = [*base, *SERVE_OVERRIDES]
    summary = run_job("deploy", *deploy_args, f"--artifact={v1}")
    assert summary["version"] == "1" and summary["url"] == SERVE
    return {
        "base": base,
        "deploy_args": deploy_args,
        "checkpoint": ckpt,
        "v1": v1,
        "v2": v2,
        "data": f"{root}/data/digits",
    }


def val_rows(output: str, n: int) -> tuple[np.ndarray, list[str]]:
    import pandas as pd

    from app.data.kinds.image import stored_pixels
    from app.data.prepare import read_manifest, split_files

    files = split_files(output, read_manifest(output), "val")  # through the manifest
    frame = pd.concat([pd.read_parquet(f) for f in files]).iloc[:n]
    return stored_pixels(frame["image"], 64), frame["label"].tolist()


def v2_body(x: np.ndarray) -> dict:
    return {
        "inputs": [
            {
                "name": "image",
                "datatype": "FP32",
                "shape": list(x.shape),
                "data": x.reshape(-1).tolist(),
            }
        ]
    }


def infer(x: np.ndarray, headers=JSON, timeout=30) -> requests.Response:
    return requests.post(
        f"{SERVE}/v2/models/digits/infer", json=v2_body(x), headers=headers, timeout=timeout
    )


def test_v1_and_v2_answers_match_the_artifact_offline(served):
    x, _ = val_rows(served["data"], 100)
    artifact = open_artifact(served["v1"])
    offline = np.asarray(artifact.preprocessor.labels)[
        run_logits(artifact.session("int8"), artifact.preprocessor.features(x)).argmax(1)
    ].tolist()
    v2 = infer(x).json()
    assert v2["model_version"] == "1"
    assert v2["outputs"][0]["name"] == "label" and v2["outputs"][0]["data"] == offline
    assert v2["outputs"][1]["shape"] == [100, 10]
    v1 = requests.post(
        f"{SERVE}/v1/models/digits:predict",
        json={"instances": x.tolist()},
        headers=JSON,
        timeout=30,
    ).json()
    assert [p["label"] for p in v1["predictions"]] == offline
    assert abs(sum(v1["predictions"][0]["probabilities"].values()) - 1) < 1e-3


def test_a_rows_answer_through_the_replica_does_not_depend_on_its_batch_mates(served):
    """The served int8 variant gives a row the same probabilities alone and inside one request
    of 256 rows with wider-ranged mates (dynamic quantization's per-call scales made them move)."""
    x, _ = val_rows(served["data"], 60)
    rng = np.random.default_rng(0)
    for i in range(20):
        alone = infer(x[i : i + 1]).json()["outputs"][1]["data"]
        mates = x[rng.integers(0, len(x), 255)] * rng.uniform(1, 4, (255, 1)).astype(np.float32)
        together = infer(np.concatenate([x[i : i + 1], mates])).json()["outputs"][1]["data"]
        assert np.abs(np.asarray(together[: len(alone)]) - np.asarray(alone)).max() <= 1e-6


def test_requests_claiming_huge_shapes_are_refused_fast_while_others_are_answered(served):
    """A 0.3 MB body claiming 30,000 dims of 999,999,999 (it once took the replica's event loop
    1.7 s to multiply them out) is refused at the first dim past its limit, and 4 MiB bodies of
    two million numbers or a million empty rows (80 ms and 380 ms to parse whole) before they
    are parsed, while a concurrent client keeps being answered."""
    import json
    import threading

    x, _ = val_rows(served["data"], 1)
    good: list[int] = []
    stop = threading.Event()

    def steady() -> None:
        while not stop.is_set():
            good.append(infer(x).status_code)

    huge_dims = {"name": "image", "shape": [1] + [999_999_999] * 30_000, "data": [1]}
    bodies = [
        ("/v2/models/digits/infer", json.dumps({"inputs": [{**huge_dims, "datatype": t}]}))
        for t in ("FP32", "BYTES")
    ]
    numbers = ",".join(["0"] * 2_000_000)
    tensor = (
        f'{{"name": "image", "datatype": "FP32", "shape": [999999999, 64], "data": [{numbers}]}}'
    )
    bodies.append(("/v2/models/digits/infer", f'{{"inputs": [{tensor}]}}'))
    empty_rows = ",".join(["[]"] * 1_000_000)
    bodies.append(("/v1/models/digits:predict", f'{{"instances": [{empty_rows}]}}'))
    thread = threading.Thread(target=steady)
    thread.start()
    try:
        timings = []
        for path, body in bodies:
            start = time.monotonic()
            r = requests.post(f"{SERVE}{path}", data=body.encode(), headers=JSON, timeout=30)
            timings.append(time.monotonic() - start)
            assert r.status_code in (400, 413) and "error" in r.json(), r.text
    finally:
        stop.set()
        thread.join()
    assert max(timings) < 1.0, timings
    assert good and set(good) == {200}


def test_health_metadata_and_model_listing(served):
    assert requests.get(f"{SERVE}/v2/health/live", timeout=5).status_code == 200
    assert requests.get(f"{SERVE}/v2/health/ready", timeout=5).status_code == 200
    assert requests.get(f"{SERVE}/v2/models/digits/ready", timeout=5).status_code == 200
    meta = get_json("/v2/models/digits")
    assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 64]}]
    models = {m["name"]: m for m in get_json("/v1/models")["models"]}
    assert (
        "digits" in models
    )  # other live models (e.g. from the job-submission test) may be listed too
    lineage = models["digits"]["manifest"]
    assert lineage["version"] == models["digits"]["version"]
    assert lineage["source_checkpoint"] == served["checkpoint"]
    assert lineage["versions"]["onnxruntime"]
    # The replica measured at start whether batched requests should share ONNX Runtime calls:
    # for the digits CNN one call on 8 rows costs a fraction of 8 calls of one.
    batching = models["digits"]["batching"]
    assert batching["setting"] == "auto" and batching["share_calls"] is True, batching
    assert batching["rows"] == 8 and batching["ms_one_call"] < batching["ms_a_call_per_row"]


BAD_REQUESTS = [
    ("empty body", b"", JSON, 400, "empty"),
    ("not JSON", b"{not json", JSON, 400, "not valid JSON"),
    ("nested 10,000 levels", b"[" * 10000 + b"]" * 10000, JSON, 400, "nested too deeply"),
    ("text/plain", b'{"inputs": []}', {"Content-Type": "text/plain"}, 415, "text/plain"),
    (
        "strings for numbers",
        b'{"inputs":[{"name":"image","datatype":"FP32","shape":[1,64],"data":['
        + b",".join([b'"1"'] * 64)
        + b"]}]}",
        JSON,
        400,
        "numbers",
    ),
    (
        "NaN",
        b'{"inputs":[{"name":"image","datatype":"FP32","shape":[1,2],"data":[NaN,1]}]}',
        JSON,
        400,
        "NaN",
    ),
    (
        "Infinity",
        b'{"inputs":[{"name":"image","datatype":"FP32","shape":[1,2],"data":[Infinity,1]}]}',
        JSON,
        400,
        "Infinity",
    ),
    (
        "wrong shape",
        b'{"inputs":[{"name":"image","datatype":"FP32","shape":[1,3],"data":[1,2,3]}]}',
        JSON,
        400,
        "64 values",
    ),
    (
        "wrong datatype",
        b'{"inputs":[{"name":"image","datatype":"BYTES","shape":[1,1],"data":["a"]}]}',
        JSON,
        400,
        "datatype",
    ),
    (
        "empty batch",
        b'{"inputs":[{"name":"image","datatype":"FP32","shape":[0,64],"data":[]}]}',
        JSON,
        400,
        "empty batch",
    ),
    ("no inputs", b'{"nothing": 1}', JSON, 400, "inputs"),
]


@pytest.mark.parametrize(
    "name,body,headers,status,fragment", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_input_gets_a_4xx_naming_the_problem(served, name, body, headers, status, fragment):
    before = {m["name"]: m for m in get_json("/v1/models")["models"]}["digits"]
    r = requests.post(f"{SERVE}/v2/models/digits/infer", data=body, headers=headers, timeout=10)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]
    assert "Traceback" not in r.text
    x, _ = val_rows(served["data"], 1)
    assert infer(x).status_code == 200  # the next good request is answered ...
    assert {m["name"]: m for m in get_json("/v1/models")["models"]}["digits"]["manifest"] == before[
        "manifest"
    ]


def test_missing_content_type_is_read_as_json(served):
    x, _ = val_rows(served["data"], 2)
    r = requests.post(f"{SERVE}/v2/models/digits/infer", data=json.dumps(v2_body(x)), timeout=10)
    assert r.status_code == 200, r.text


def test_size_and_row_limits_and_unknown_model(served):
    big = b'{"instances": [' + b"0," * 3_000_000 + b"0]}"
    r = requests.post(f"{SERVE}/v1/models/digits:predict", data=big, headers=JSON, timeout=30)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]
    too_many = np.zeros((1025, 64), np.float32)
    r = infer(too_many)
    assert r.status_code == 413 and "max_request_rows" in r.json()["error"]
    r = requests.post(
        f"{SERVE}/v2/models/nope/infer", json=v2_body(too_many[:1]), headers=JSON, timeout=10
    )
    assert r.status_code == 404 and "nope" in r.json()["error"]


def answering_pid(x: np.ndarray) -> int:
    r = infer(x)
    assert r.status_code == 200, r.text
    # One request id, Serve's: a second copy from the app would read "id, id" here.
    assert r.headers["x-request-id"] and "," not in r.headers["x-request-id"], r.headers
    return int(r.headers["x-model-replica"])


def test_replica_process_survives_bad_requests(served):
    x, _ = val_rows(served["data"], 1)
    pids = {answering_pid(x) for _ in range(5)}
    for _, body, headers, _, _ in BAD_REQUESTS:
        requests.post(f"{SERVE}/v2/models/digits/infer", data=body, headers=headers, timeout=10)
    assert {answering_pid(x) for _ in range(5)} <= pids


def _v2(datatype: str = "FP32", shape=(1, 64), data=None, **extra) -> bytes:
    """A v2 body for digits' input; json.dumps writes a lone surrogate as the escape "\\ud800"."""
    tensor = {"name": "image", "datatype": datatype, "shape": list(shape), "data": data}
    if tensor["data"] is None and datatype == "FP32":
        tensor["data"] = [0.0] * 64
    tensor.update(extra.pop("tensor", {}))
    return json.dumps({"inputs": [tensor], **extra}).encode()


INFER, PREDICT = "/v2/models/digits/infer", "/v1/models/digits:predict"
NAMED = "'Z\u00c6' not found"
# Malformed requests: (what, method, path, body, status, fragment of the JSON error).
MALFORMED_REQUESTS = [
    (
        "text [1, 5000]",
        "POST",
        INFER,
        _v2("BYTES", [1, 5000], ["a"] * 5000),
        413,
        "max_request_rows",
    ),
    # digits is numeric: a 5000-string instance is refused as strings (a text model: 413).
    (
        "v1 5000 strings",
        "POST",
        PREDICT,
        json.dumps({"instances": [["a"] * 5000]}).encode(),
        400,
        "numbers",
    ),
    ("parameters list", "POST", INFER, _v2(parameters=[1]), 400, "parameters: expected an object"),
    (
        "input parameters",
        "POST",
        INFER,
        _v2(tensor={"parameters": "x"}),
        400,
        "inputs[0].parameters",
    ),
    ("outputs number", "POST", INFER, _v2(outputs=3), 400, "outputs: expected a list"),
    ("text data number", "POST", INFER, _v2("BYTES", [1, 1], 5), 400, "inputs[0].data"),
    (
        "text data null",
        "POST",
        INFER,
        _v2("BYTES", [1, 1], None),
        400,
        "inputs[0].data",
    ),
    ("text data string", "POST", INFER, _v2("BYTES", [1, 1], "abc"), 400, "inputs[0].data"),
    ("surrogate v2", "POST", INFER, _v2("FP32", [1, 1], ["\ud800"]), 400, "inputs[0]"),
    (
        "surrogate v1",
        "POST",
        PREDICT,
        json.dumps({"instances": [["\ud800"]]}).encode(),
        400,
        "instances[0]",
    ),
    ("non-ASCII ready", "GET", "/v2/models/Z%C3%86/ready", b"", 404, NAMED),
    ("non-ASCII metadata", "GET", "/v2/models/Z%C3%86", b"", 404, NAMED),
    ("non-ASCII infer", "POST", "/v2/models/Z%C3%86/infer", _v2(), 404, NAMED),
    ("non-ASCII v1", "POST", "/v1/models/Z%C3%86:predict", b'{"instances": [[1]]}', 404, NAMED),
]


def test_bad_requests_get_4xx_and_the_replica_survives(served):
    """Every malformed request above against the live endpoint, interleaved with good
    requests: each gets its 4xx with a JSON error naming the field, the good ones all succeed,
    and the same replica process answers before and after."""
    from concurrent.futures import ThreadPoolExecutor

    x, _ = val_rows(served["data"], 1)
    pids = {answering_pid(x) for _ in range(5)}

    def send(case):
        _, method, path, body, _, _ = case
        return requests.request(method, f"{SERVE}{path}", data=body, headers=JSON, timeout=30)

    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(infer, x) for _ in range(len(MALFORMED_REQUESTS))]
        answers = list(pool.map(send, MALFORMED_REQUESTS))
    for (what, _, _, _, status, fragment), r in zip(MALFORMED_REQUESTS, answers, strict=True):
        assert r.status_code == status, f"{what}: {r.status_code} {r.text[:300]}"
        assert r.headers["content-type"].startswith("application/json"), what
        assert fragment in r.json()["error"], f"{what}: {r.json()}"
    assert [f.result().status_code for f in good] == [200] * len(good)
    assert {answering_pid(x) for _ in range(5)} <= pids


def test_triton_client_reads_metadata_and_infers_json_and_binary(served):
    import tritonclient.http as triton

    client = triton.InferenceServerClient("127.0.0.1:8000")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("digits")
    assert client.get_model_metadata("digits")["inputs"][0]["name"] == "image"
    x, _ = val_rows(served["data"], 16)
    expected = infer(x).json()["outputs"][0]["data"]
    for binary in (False, True):
        tensor = triton.InferInput("image", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        outputs = [
            triton.InferRequestedOutput(n, binary_data=binary) for n in ("label", "probabilities")
        ]
        result = client.infer("digits", [tensor], outputs=outputs)
        labels = [v.decode() if isinstance(v, bytes) else str(v) for v in result.as_numpy("label")]
        assert labels == expected
        assert result.as_numpy("probabilities").shape == (16, 10)


class Load(ClosedLoop):
    """Closed-loop load from a few threads: status codes, answering versions and replica pids."""

    def __init__(
        self,
        x: np.ndarray,
        threads: int = 3,
        pause: float = 0.0,
        expected: list | None = None,
        headers: dict[str, str] = JSON,
    ):
        self.x, self.pause, self.expected, self.headers = x, pause, expected, headers
        self.wrong = 0  # 200 answers whose labels differ from `expected`, when given
        self.codes: Counter = Counter()
        self.versions: list[tuple[float, str]] = []
        self.pids: Counter = Counter()
        self.errors: list[str] = []
        self.error_seconds: list[float] = []  # how long each failed request took
        self.error_started: list[float] = []  # when each failed request was sent (monotonic)
        super().__init__(threads)

    def _run(self):
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                r = infer(self.x, headers=self.headers, timeout=30)
                self.codes[r.status_code] += 1
                if r.status_code == 200:
                    self.versions.append((time.monotonic(), r.json()["model_version"]))
                    self.pids[int(r.headers["x-model-replica"])] += 1
                    if self.expected is not None:
                        self.wrong += r.json()["outputs"][0]["data"] != self.expected
                else:
                    self._failed(f"{r.status_code} {r.text[:200]}", start)
            except Exception as e:  # noqa: BLE001 - a bad answer counts as a failure, not a dead thread
                self.codes["exception"] += 1
                self._failed(repr(e)[:200], start)
            time.sleep(self.pause)

    def _failed(self, error: str, start: float) -> None:
        self.errors.append(error)
        self.error_seconds.append(time.monotonic() - start)
        self.error_started.append(start)

    @property
    def failures(self) -> int:
        return sum(n for code, n in self.codes.items() if code != 200)


def answering_version(model: str) -> str | None:
    """The version the model answers with now; None while a rollout keeps it from answering
    (a poll retries that, it is not the failure being tested)."""
    try:
        r = requests.get(f"{SERVE}/v2/models/{model}", timeout=5)
    except requests.RequestException:
        return None
    return (r.json().get("versions") or [None])[0] if r.status_code == 200 else None


def running_replicas() -> int:
    """The digits deployment's RUNNING replicas, from Serve's REST API on the dashboard (what
    `serve status` reads; polled here without starting a CLI process, 1.7 CPU-s, per poll)."""
    from tests.e2e.conftest import DASHBOARD, read_token

    r = requests.get(
        f"{DASHBOARD}/api/serve/applications/",
        headers={"Authorization": f"Bearer {read_token()}"},
        timeout=30,
    )
    r.raise_for_status()
    for app in (r.json().get("applications") or {}).values():
        deployment = (app.get("deployments") or {}).get("model-digits")
        if deployment:
            return sum(rep.get("state") == "RUNNING" for rep in deployment.get("replicas") or [])
    return 0


def test_autoscaling_up_under_load_and_back_down(served):
    wait_for(lambda: running_replicas() == 1, 90, 1, "one replica at rest")
    x, _ = val_rows(served["data"], 32)
    with Load(x, threads=6) as load:
        wait_for(lambda: running_replicas() >= 2, 90, 1, "a second replica under load")
        wait_for(lambda: len(load.pids) >= 2, 30, 0.5, "both replicas answering")
    assert load.failures == 0, load.errors[:3]
    wait_for(lambda: running_replicas() == 1, 120, 1, "scale back to one replica")


def test_killed_replica_is_replaced_and_service_keeps_answering(served):
    x, _ = val_rows(served["data"], 8)
    expected = infer(x).json()["outputs"][0]["data"]
    threads = 6
    with Load(x, threads=threads, expected=expected) as load:
        wait_for(
            lambda: running_replicas() >= 2 and len(load.pids) >= 2, 90, 1, "two serving replicas"
        )
        victim = load.pids.most_common(1)[0][0]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        answered_before = sum(load.pids.values())
        wait_for(
            lambda: sum(load.pids.values()) > answered_before + 20,
            30,
            0.2,
            "answers after the kill",
        )
        wait_for(lambda: running_replicas() >= 2, 30, 0.5, "a replacement replica")
        replaced_in = time.monotonic() - killed_at
    assert replaced_in < 30
    # What a SIGKILL can cost, measured over 30 kills (docs/architecture.md, "Sharp edges"):
    # HAProxy replays most requests the dead replica left unanswered
    # (RAY_SERVE_HAPROXY_RETRY_ON), but an answer the replica had begun (headers sent, body not)
    # cannot be replayed, and a few reach it in the instant before HAProxy marks it down. Those
    # fail, each fast, with a broken connection or HAProxy's own plain-text 500 (its 502,
    # renamed by Serve); none waits out a timeout, none gets a wrong answer or the app's own
    # error, and none is sent after the first second past the kill: by then HAProxy routes
    # around the dead replica.
    assert load.wrong == 0
    assert load.failures <= threads, load.errors[:5]
    for error, seconds, started in zip(
        load.errors, load.error_seconds, load.error_started, strict=True
    ):
        assert error.startswith(KILLED_REPLICA_ERRORS), error
        assert seconds < 5, (error, seconds)
        assert started < killed_at + 1, (error, started - killed_at)


# How a request cut off by a killed replica may fail (see the killed-replica test).
KILLED_REPLICA_ERRORS = (
    # HAProxy's page for a request it could not answer (its 502, renamed by Serve). The same
    # plain text is Serve's own answer when a replica's user code raises outside our handlers;
    # our app's own 500s carry a JSON error and still fail the test.
    "500 Internal Server Error",
    "503 ",
    "ConnectionError(",
    "ChunkedEncodingError(",
)


def test_rolling_update_to_v2_and_rollback_fail_no_request(served):
    x, _ = val_rows(served["data"], 4)
    for target, version in ((served["v2"], "2"), (served["v1"], "1")):
        with Load(x, threads=3, pause=0.02) as load:
            time.sleep(1)
            summary = run_job("deploy", *served["deploy_args"], f"--artifact={target}")
            done_at = time.monotonic()
            assert summary["version"] == version
            time.sleep(2)
        assert load.failures == 0, load.errors[:5]
        after = [v for t, v in load.versions if t > done_at]
        assert after and set(after) == {version}
        assert get_json("/v2/models/digits")["versions"] == [version]


def test_serve_deploy_of_cluster_serve_yaml_runs_the_same_app(served, tmp_path):
    """`serve deploy cluster/serve.yaml` (artifact pointed at this test's v2) serves the model."""
    import subprocess

    import yaml

    from tests.e2e.conftest import DASHBOARD, job_env

    config = yaml.safe_load((REPO / "cluster/serve.yaml").read_text())
    [digits] = [a for a in config["applications"] if a["name"] == "models-digits"]
    digits["args"]["model"]["artifact"] = served["v2"]
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [str(REPO / ".venv/bin/serve"), "deploy", str(path), "--address", DASHBOARD],
        capture_output=True,
        text=True,
        env=job_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    wait_for(lambda: answering_version("digits") == "2", 120, 1, "version 2 from serve.yaml")
    x, _ = val_rows(served["data"], 8)
    r = infer(x)
    assert r.status_code == 200 and r.json()["model_version"] == "2"


# The last two tests change the application for good (the key stays on; a second model joins),
# so they run last instead of paying for a redeploy that restores the earlier state.


def test_no_listener_of_the_cluster_binds_beyond_loopback(served):
    """cluster/start.sh binds on RAYTORCH_BIND_HOST (loopback by default): Serve's HTTP port and
    HAProxy's stats and Prometheus listeners too, which Ray's template binds to every interface."""
    import psutil

    ports = {8000: "Serve HTTP", 8404: "HAProxy stats", 9101: "HAProxy metrics"}
    listening = {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports
    }
    assert {port for _, port in listening} == set(ports), listening  # HAProxy mode is on
    public = [f"{ports[port]} on {ip}:{port}" for ip, port in listening if ip != "127.0.0.1"]
    assert public == []


def serving_listeners() -> dict[str, set[int]]:
    """The ports the cluster's Serve processes listen on, by process name (ray::ProxyActor,
    ray::ServeReplica:...), on loopback."""
    import psutil

    found: dict[str, set[int]] = {}
    for c in psutil.net_connections(kind="tcp"):
        if c.status != psutil.CONN_LISTEN or c.laddr.ip != "127.0.0.1" or c.pid is None:
            continue
        try:
            name = " ".join(psutil.Process(c.pid).cmdline())  # Ray's process title
        except psutil.Error:
            continue
        if name.startswith(("ray::ProxyActor", "ray::ServeReplica")):
            found.setdefault(name.split()[0].removeprefix("ray::"), set()).add(c.laddr.port)
    return found


def test_the_cluster_serves_on_ports_of_its_own(served):
    """HAProxy routes by host:port, so cluster/start.sh keeps its Serve off the ports every other
    Serve on the machine takes: its fallback proxy on the Serve port + 1, not Ray's 8500 (which
    every cluster's proxy binds, with SO_REUSEPORT: a second cluster would answer some of this
    one's requests with its own models), its replicas in 20000-20499, not 30000 and up."""
    listening = serving_listeners()
    assert listening["ProxyActor"] == {8001}, listening
    replicas = {p for name, ports in listening.items() if name != "ProxyActor" for p in ports}
    assert replicas and all(20000 <= p < 20500 for p in replicas), listening


def test_api_key_is_required_when_set(served):
    os.environ[TEST_API_KEY_ENV] = TEST_API_KEY  # the deploy job checks the model with the key
    run_job(
        "deploy",
        *served["deploy_args"],
        f"serve.api_key_env={TEST_API_KEY_ENV}",
        f"--artifact={served['v1']}",
    )
    x, _ = val_rows(served["data"], 1)
    assert infer(x).status_code == 401
    assert infer(x, headers={**JSON, "Authorization": "Bearer wrong"}).status_code == 403
    assert infer(x, headers=AUTHORIZED).status_code == 200
    assert requests.get(f"{SERVE}/v2/health/live", timeout=5).status_code == 200  # probes stay open


def test_s3_registry_export_deploy_and_infer(served, s3_bucket):
    """Export to an `s3://` registry with the job, deploy from there with the job, and the
    replicas (which read the artifact from S3 themselves) answer like the artifact offline."""
    registry = f"{s3_bucket}/registry"
    exported = run_job(
        "export",
        *served["base"],
        f"export.registry={registry}",
        "export.name=digits-s3",
        f"--checkpoint={served['checkpoint']}",
    )
    assert exported["artifact"] == f"{registry}/digits-s3/1"
    latest = f"{registry}/digits-s3/latest"
    os.environ[TEST_API_KEY_ENV] = TEST_API_KEY  # the key from the test above stays on
    try:
        deployed = run_job(
            "deploy",
            *served["deploy_args"],
            f"serve.api_key_env={TEST_API_KEY_ENV}",
            f"--artifact={latest}",
        )
    finally:
        os.environ.pop(TEST_API_KEY_ENV, None)
    assert deployed["artifact"] == exported["artifact"] and deployed["version"] == "1"
    assert {"digits", "digits-s3"} <= set(deployed["models"])  # beside any other live models

    x, _ = val_rows(served["data"], 20)
    artifact = open_artifact(latest)
    offline = np.asarray(artifact.preprocessor.labels)[
        run_logits(artifact.session("int8"), artifact.preprocessor.features(x)).argmax(1)
    ].tolist()
    r = requests.post(
        f"{SERVE}/v2/models/digits-s3/infer", json=v2_body(x), headers=AUTHORIZED, timeout=30
    )
    assert r.status_code == 200, r.text
    assert r.json()["model_version"] == "1" and r.json()["outputs"][0]["data"] == offline
    assert infer(x[:1], headers=AUTHORIZED).status_code == 200  # the first model still serves


def test_models_list_undeploy_and_prune_against_the_live_cluster(served):
    """`jobs.models`: the registry's versions with the live one, a model taken off Serve while
    the other keeps answering, and prune keeping the live version even when it is not newest."""
    os.environ[TEST_API_KEY_ENV] = TEST_API_KEY  # the key from the tests above stays on
    try:
        listing = run_job("models", *served["base"], "list")
        [digits] = listing["models"]
        assert digits["latest"] == "2" and digits["live"] == "1"  # the API-key test deployed v1
        assert [(v["version"], v["live"]) for v in digits["versions"]] == [
            ("1", True),
            ("2", False),
        ]
        assert digits["versions"][0]["gate"]["int8_accuracy"] > 0.9

        undeployed = run_job("models", *served["base"], "undeploy", "digits-s3")
        # digits keeps serving (other modules' models, pretrained ones, may be live too)
        assert "digits" in undeployed["models"] and "digits-s3" not in undeployed["models"]
        r = requests.post(
            f"{SERVE}/v2/models/digits-s3/infer",
            json=v2_body(val_rows(served["data"], 1)[0]),
            headers=AUTHORIZED,
            timeout=30,
        )
        assert r.status_code == 404
        assert infer(val_rows(served["data"], 1)[0], headers=AUTHORIZED).status_code == 200

        pruned = run_job("models", *served["base"], "prune", "--keep=1")
        assert pruned["deleted"] == {"digits": []}  # v2 is the newest and latest, v1 is live
    finally:
        os.environ.pop(TEST_API_KEY_ENV, None)


def alive_actor_pids(class_name: str) -> list[int]:
    """Pids of the cluster's live actors of a class (`ServeController`, or a replica class such
    as `ServeReplica:models:Index`), from the dashboard's state API (token auth)."""
    from tests.e2e.conftest import DASHBOARD, read_token

    filters = {"state": "ALIVE", "class_name": class_name}
    params: list[tuple[str, str]] = [("limit", "1000")]
    for key, value in filters.items():
        params += [("filter_keys", key), ("filter_predicates", "="), ("filter_values", value)]
    r = requests.get(
        f"{DASHBOARD}/api/v0/actors",
        params=params,
        headers={"Authorization": f"Bearer {read_token()}"},
        timeout=30,
    )
    r.raise_for_status()
    return [a["pid"] for a in r.json()["data"]["result"]["result"]]


def test_serve_controller_killed_under_load_loses_no_request(served):
    """The controller only manages: with it dead, the proxy and replicas keep answering, and
    Ray restarts it (a detached actor) with the applications as they were."""
    x, _ = val_rows(served["data"], 4)
    [old] = alive_actor_pids("ServeController")
    # The key an earlier test turned on may still be required: send it either way.
    with Load(x, threads=3, pause=0.01, headers=AUTHORIZED) as load:
        time.sleep(1)
        os.kill(old, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(
            lambda: [p for p in alive_actor_pids("ServeController") if p != old],
            90,
            1,
            "a new controller",
        )
        back_in = time.monotonic() - killed_at
        answered = sum(load.pids.values())
        wait_for(lambda: sum(load.pids.values()) > answered + 20, 30, 0.2, "answers after")
    print(
        f"controller killed: a new one alive after {back_in:.1f} s; {sum(load.pids.values())} answers, {load.failures} failures"
    )
    assert load.failures == 0, load.errors[:5]
    assert running_replicas() >= 1  # Serve's REST API answers: the new controller took over
    assert back_in < 60


def test_index_replica_killed_under_load_is_replaced_and_answers_resume(served):
    """Routes on the index application (v1 predict, /v1/models) are unanswerable while its only
    replica is gone; Serve starts another and they resume. Failures stay inside that window and
    fail fast; none is a wrong answer. (Two index replicas, `serve.ingress_replicas: 2`, avoid
    the window.)"""
    killed = kill_the_index_under_load(served)
    print(
        f"index replica killed: answers resumed after {killed.recovered_in:.1f} s; "
        f"{len(killed.failed)} failures"
    )
    assert killed.wrong == [], killed.wrong[:2]  # a 200 is never another model's answer
    assert killed.recovered_in < 30
    within = [f for f in killed.failed if -1 < f[0] < killed.recovered_in + 1 and f[2] < 31]
    assert within == killed.failed, killed.failed[:5]


@dataclass
class Killed:
    recovered_in: float
    failed: list[tuple[float, int | str, float]]  # (sent after the kill, status or error, s)
    wrong: list[dict]  # 200s whose predictions are not the model's (sent after the kill, body)


def kill_the_index_under_load(served) -> Killed:
    """Three clients on /v1/models/digits:predict; the index replica SIGKILLed a second in and
    the load kept on until a replacement answers, and a second more."""
    x, _ = val_rows(served["data"], 4)
    url = f"{SERVE}/v1/models/digits:predict"
    body = {"instances": x.tolist()}
    expected = requests.post(url, json=body, headers=AUTHORIZED, timeout=30).json()["predictions"]
    [victim] = alive_actor_pids("ServeReplica:models:Index")
    outcomes: list[tuple[float, int | str, float]] = []  # (sent, status or error, seconds)
    wrong: list[dict] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                r = requests.post(url, json=body, headers=AUTHORIZED, timeout=30)
                outcomes.append((start, r.status_code, time.monotonic() - start))
                if r.status_code == 200 and r.json()["predictions"] != expected:
                    wrong.append({"sent": start, "body": r.json()})
            except requests.RequestException as e:
                outcomes.append((start, type(e).__name__, time.monotonic() - start))
            time.sleep(0.02)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()

        def resumed() -> bool:
            return any(s > killed_at + 0.5 and code == 200 for s, code, _ in outcomes[-10:])

        wait_for(resumed, 60, 0.2, "answers from a replacement index replica")
        recovered_in = time.monotonic() - killed_at
        time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    failed = [(s - killed_at, code, secs) for s, code, secs in outcomes if code != 200]
    assert alive_actor_pids("ServeReplica:models:Index") not in ([], [victim])
    return Killed(recovered_in, failed, wrong)


@pytest.mark.slow
def test_another_serve_on_the_machine_never_answers_for_this_one(served, tmp_path):
    """A second Serve cluster on the machine (Ray's defaults, HAProxy mode: its fallback proxy
    on 8500, its replicas from 30000) serving a model of the same name that answers otherwise
    (the fp32 variant); this cluster's index replica is killed under load, so HAProxy sends its
    requests to its fallback proxy while the replacement starts: every 200 is this cluster's
    own model's answer."""
    from bench.b5_serve import start_ht_child, wait_child_ready
    from bench.common import free_port

    log = tmp_path / "other-serve.log"
    other = start_ht_child(
        served["v1"], {"variant": "fp32", "replica_cpus": 0.25}, free_port(), str(tmp_path), log
    )
    try:
        wait_child_ready(other, 180, log)
        killed = kill_the_index_under_load(served)
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=120)
    assert killed.wrong == [], killed.wrong[:2]
