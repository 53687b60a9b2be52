"""The simple JSON API: the model list and `{"instances": [...]}` predictions."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request

from app.runtime.types import InferRequest, ModelInfo
from app.serve.http.clients import INFO_FRESH_S
from app.serve.http.protocol import decode_v1
from app.serve.http.routes.common import body, config, models

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
