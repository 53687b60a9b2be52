"""The simple JSON API: the model list and `{"instances": [...]}` predictions."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request

from app.runtime.rows import too_many_rows
from app.runtime.types import InferRequest, ModelInfo, bad
from app.serve.http.clients import INFO_FRESH_S
from app.serve.http.gate import body, parse_json
from app.serve.http.routes.common import config, models

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request):
    """The project's listing (`models`) and, in the same answer, OpenAI's (`object`, `data`),
    which OpenAI clients read (`client.models.list()`)."""
    m = models(request)
    infos = await asyncio.gather(*(m.info(name) for name in sorted(m.clients)))
    return {
        "models": [info.listing() for info in infos],
        "object": "list",
        "data": [openai_model(info) for info in infos],
    }


def openai_model(info: ModelInfo) -> dict[str, Any]:
    created = info.manifest.get("created")
    try:  # when the version was published, as OpenAI's `created` (Unix seconds)
        seconds = int(datetime.fromisoformat(created).timestamp()) if created else 0
    except ValueError:
        seconds = 0
    return {"id": info.name, "object": "model", "created": seconds, "owned_by": "raytorch"}


@router.post("/v1/models/{name}:predict")
async def predict(name: str, request: Request):
    m = models(request)
    max_rows = config(request).max_request_rows
    info = await m.info(name, INFO_FRESH_S)  # the schema bounds what is parsed
    instances = decode_v1(await body(request, inputs=info.inputs), max_rows)
    result = await m.infer(name, InferRequest(instances=instances))
    names = result.label_names
    return {
        "model_name": name,
        "model_version": result.version,
        "predictions": [
            {"label": label, "probabilities": dict(zip(names, map(float, probs), strict=True))}
            for label, probs in zip(result.labels, result.probabilities, strict=True)
        ],
    }


def decode_v1(body: bytes, max_rows: int) -> list[Any]:
    request = parse_json(body)
    if not isinstance(request, dict) or "instances" not in request:
        raise bad("body: expected a JSON object with 'instances'")
    instances = request["instances"]
    if not isinstance(instances, list):
        raise bad("instances: expected a list (one instance per row)")
    if not instances:
        raise bad("instances: empty batch (no rows)")
    if len(instances) > max_rows:
        raise too_many_rows(len(instances), max_rows)
    return instances
