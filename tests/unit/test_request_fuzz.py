"""Hostile values in every field of every request body: never a 500, and a number field given
anything but a number in its range is a 400 naming that field.

The generation fields are enumerated from their request models (app/serve/http/protocol.py), so a
field added there is fuzzed too; the classifier routes' numeric fields (v2 tensors, v1
instances) are listed here, as their wire format is read by hand (app/serve/http/routes/v2.py and v1.py). The
models behind the routes are stand-ins that run what the real replicas run on the values: the
row check (app/runtime/rows.py) and the sampler (app/runtime/decoding.py).
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from app.config import ServeConfig
from app.runtime.decoding import SamplingParams, sample
from app.runtime.rows import request_rows
from app.runtime.types import Finished, InferResult, ModelInfo, Piece, Started
from app.serve.http.api import create_api
from app.serve.http.clients import Models
from app.serve.http.protocol import Strict
from app.tasks.lm.http.protocol import ChatRequest, CompletionRequest, GenerateRequest

pytestmark = pytest.mark.unit

# Raw JSON texts: 1e400 parses to inf, the integers have hundreds of digits.
HOSTILE = [
    "9" * 400,
    "-" + "9" * 400,
    "1e400",
    "-1e400",
    "-1",
    '"1"',
    "true",
    "[1]",
    '{"a": 1}',
    "1.5",
]
PLAIN_NUMBERS = ("-1", "1.5")  # in range for some number fields: those may be answered
SCHEMA = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 2]}]}
INFO = ModelInfo(
    name="m",
    version="1",
    variant="int8",
    artifact="/a",
    task="classify",
    generates=False,
    inputs=SCHEMA["inputs"],
    outputs=[],
    labels=["a", "b"],
    manifest={},
    replica_pid=1,
)


class Checking:
    """A classifier that checks rows as the replica does; a language model that samples with
    the request's parameters as the decode loop does."""

    def __init__(self, generates: bool):
        self.generates = generates

    async def info(self) -> ModelInfo:
        return replace(INFO, task="lm", generates=True) if self.generates else INFO

    async def infer(self, request) -> InferResult:
        rows = request_rows(request, SCHEMA, 1024)
        return InferResult(["a"] * len(rows), np.full((len(rows), 2), 0.5), "1", ["a", "b"], 1)

    async def generate(self, request):
        params = SamplingParams(**request.params)
        rng = np.random.default_rng(params.seed)
        logits = rng.standard_normal(64).astype(np.float32)
        token = sample(params.penalized(logits, {3: 2}), params, rng)
        yield Started(prompt_tokens=1, version="1")
        yield Piece(str(token))
        yield Finished("length", 1, 1, "1")


@pytest.fixture(scope="module")
def api():
    cfg = ServeConfig()
    models = Models({"m": Checking(False), "lm": Checking(True)}, 5)
    return TestClient(create_api(cfg, models))


def leaf_fields(model: type[BaseModel], at: tuple[Any, ...] = ()) -> list[tuple[tuple, Any]]:
    """(path, annotation) of every field of a request model, nested models and lists of them
    walked into (a list's path goes through its first item)."""
    out = []
    for name, info in model.model_fields.items():
        path, annotation = (*at, name), info.annotation
        nested = _model_in(annotation)
        if nested is not None:
            out += leaf_fields(nested, (*path, 0) if _is_list(annotation) else path)
        else:
            out.append((path, annotation))
    return out


def _args(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _is_list(annotation: Any) -> bool:
    return any(typing.get_origin(a) is list for a in _args(annotation))


def _model_in(annotation: Any) -> type[BaseModel] | None:
    for a in _args(annotation):
        inner = typing.get_args(a)[0] if typing.get_origin(a) is list else a
        if isinstance(inner, type) and issubclass(inner, Strict):
            return inner
    return None


def is_number(annotation: Any) -> bool:
    kinds = [typing.get_origin(a) and typing.get_args(a)[0] or a for a in _args(annotation)]
    return any(k in (int, float) for k in kinds)


ROUTES = [
    ("/v1/completions", CompletionRequest, {"model": "lm", "prompt": "hi"}),
    (
        "/v1/chat/completions",
        ChatRequest,
        {"model": "lm", "messages": [{"role": "user", "content": "hi"}]},
    ),
    ("/v2/models/lm/generate", GenerateRequest, {"text_input": "hi", "parameters": {}}),
]
CASES = [
    (route, base, path, annotation)
    for route, model, base in ROUTES
    for path, annotation in leaf_fields(model)
]


def dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out


def with_value(base: dict[str, Any], path: tuple, raw: str) -> bytes:
    """`base` as JSON text with the raw JSON text `raw` at `path`."""
    body = json.loads(json.dumps(base))
    if path[0] == "stream_options":
        body["stream"] = True  # stream_options is refused without it
    node = body
    for part in path[:-1]:
        node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]
    node[path[-1]] = "@@HOSTILE@@"
    return json.dumps(body).replace('"@@HOSTILE@@"', raw).encode()


def test_every_field_of_the_request_models_is_enumerated():
    names = {dotted(path) for _, _, path, _ in CASES}
    assert {"max_tokens", "temperature", "seed", "top_p", "n", "logprobs"} <= names
    assert {"messages[0].role", "stream_options.include_usage", "parameters.seed"} <= names
    assert {dotted(p) for _, _, p, a in CASES if is_number(a)} >= {
        "frequency_penalty",
        "top_logprobs",
        "max_completion_tokens",
        "parameters.presence_penalty",
    }


@pytest.mark.parametrize(("route", "base", "path", "annotation"), CASES, ids=lambda v: str(v))
def test_hostile_values_in_a_generation_field_are_never_a_500(api, route, base, path, annotation):
    field = dotted(path)
    for raw in HOSTILE:
        answer = api.post(route, content=with_value(base, path, raw))
        assert answer.status_code < 500, (field, raw, answer.text)
        if is_number(annotation) and raw not in PLAIN_NUMBERS:
            assert answer.status_code == 400, (field, raw, answer.text)
        if answer.status_code >= 400:
            error = answer.json()["error"]
            message = error["message"] if isinstance(error, dict) else error
            named = field if answer.status_code == 400 else path[0]  # 404: the model's name
            assert message.startswith(named) and "\n" not in message, (raw, message)
            assert len(message) < 300


CLASSIFIER_FIELDS = [
    (
        "/v2/models/m/infer",
        {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]},
        path,
    )
    for path in (
        ("inputs", 0, "shape", 0),
        ("inputs", 0, "shape", 1),
        ("inputs", 0, "data", 0),
        ("inputs", 0, "parameters", "binary_data_size"),
    )
] + [("/v1/models/m:predict", {"instances": [[1, 2]]}, ("instances", 0, 0))]


@pytest.mark.parametrize(("route", "base", "path"), CLASSIFIER_FIELDS, ids=lambda v: str(v))
def test_hostile_values_in_a_classifier_field_are_a_400_naming_it(api, route, base, path):
    for raw in HOSTILE:
        if raw in PLAIN_NUMBERS and (path[-2] == "data" or path[0] == "instances"):
            continue  # a valid feature value
        answer = api.post(route, content=with_value(base, path, raw))
        assert 400 <= answer.status_code < 500, (path, raw, answer.text)
        assert dotted(path[:2]) in answer.json()["error"], (path, raw, answer.text)


def test_a_seed_beyond_int64_is_refused_and_int64s_largest_samples(api):
    body = {"model": "lm", "prompt": "hi", "seed": 2**63}
    answer = api.post("/v1/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("seed")
    body["seed"] = 2**63 - 1
    assert api.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("route", "length"),
    [("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_completion_tokens")],
)
def test_n_times_max_tokens_beyond_the_request_budget_is_a_400_naming_both(api, route, length):
    """16 x 512 tokens would put minutes of one request's sampling on the shared decode thread."""
    base = {"model": "lm", "n": 16, length: 512}
    base |= (
        {"prompt": "hi"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    answer = api.post(route, json=base)
    message = answer.json()["error"]["message"]
    assert answer.status_code == 400, answer.text
    assert "n:" in message and length in message and "max_request_tokens" in message
    assert api.post(route, json=base | {"n": 8}).status_code == 200  # 8 x 512 = 4096 fits
