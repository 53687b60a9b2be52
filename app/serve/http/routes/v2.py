"""Open Inference Protocol v2: server and model metadata, health, and inference.

A v2 inference, end to end: `infer` (this module) -> `decode_v2` (protocol) -> `Models.infer`
(clients) -> `ModelServer.infer` (the replica: schema check, preprocess, batch, ONNX Runtime)
-> `encode_v2` (protocol).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app import __version__
from app.runtime.types import ModelInfo, RequestError
from app.serve.http.clients import INFO_FRESH_S, Models
from app.serve.http.middleware import error
from app.serve.http.protocol import BINARY_HEADER, decode_v2, encode_v2
from app.serve.http.routes.common import body, models

router = APIRouter()


@router.get("/v2")
async def server_metadata():
    return {"name": "raytorch", "version": __version__, "extensions": ["binary_tensor_data"]}


@router.get("/v2/health/live")
async def live():
    return {"live": True}


@router.get("/v2/health/ready")
async def ready(request: Request):
    """Answered from what the models said at most INFO_FRESH_S ago: the probe is public, so it
    must not put a call into every replica's queue per request."""
    m = models(request)
    try:
        await asyncio.gather(*(m.info(name, INFO_FRESH_S) for name in m.clients))
    except Exception as e:  # noqa: BLE001 - not ready is an answer, not a crash
        return error(503, f"not ready: {type(e).__name__}")
    return {"ready": True}


@router.get("/v2/models/{name}")
@router.get("/v2/models/{name}/versions/{version}")
async def model_metadata(name: str, request: Request, version: str | None = None):
    info = await live_version(models(request), name, version, fresh_within_s=0.0)
    parameters: dict[str, Any] = {"labels": info.labels, "variant": info.variant}
    if info.generation is not None:
        parameters["generation"] = info.generation
    return {
        "name": name,
        "versions": [info.version],
        "platform": "onnxruntime_onnx",
        "inputs": info.inputs,
        "outputs": info.outputs,
        "parameters": parameters,
    }


@router.get("/v2/models/{name}/ready")
@router.get("/v2/models/{name}/versions/{version}/ready")
async def model_ready(name: str, request: Request, version: str | None = None):
    await live_version(models(request), name, version, fresh_within_s=0.0)
    return {"name": name, "ready": True}


@router.post("/v2/models/{name}/infer")
async def infer_live(name: str, request: Request):
    return await infer(name, request)


@router.post("/v2/models/{name}/versions/{version}/infer")
async def infer_version(name: str, version: str, request: Request):
    return await infer(name, request, version)


async def infer(name: str, request: Request, version: str | None = None) -> Response:
    """Both infer routes (a separate route each: with an optional `version` parameter, FastAPI
    would read it from the query string of every unversioned request)."""
    m: Models = request.app.state.models
    info = await m.info(name, INFO_FRESH_S)  # its schema bounds what is parsed
    if version is not None and version != info.version:  # a 404 before any model runs
        raise not_deployed(name, version, info.version)
    header_length = request.headers.get(BINARY_HEADER)
    raw = await body(request, binary=header_length is not None, inputs=info.inputs)
    parsed = decode_v2(raw, header_length, m.max_request_rows)
    result = await m.infer(name, parsed.request)
    if version is not None and version != result.version:  # redeployed meanwhile
        raise not_deployed(name, version, result.version)
    content, headers = encode_v2(name, parsed.id, result, parsed.binary_outputs)
    headers["x-model-replica"] = str(result.replica_pid)
    return Response(content=content, headers=headers)


async def live_version(
    m: Models, name: str, version: str | None, fresh_within_s: float
) -> ModelInfo:
    info = await m.info(name, fresh_within_s)
    if version is not None and version != info.version:
        raise not_deployed(name, version, info.version)
    return info


def not_deployed(name: str, version: str, live: str) -> RequestError:
    return RequestError(404, f"model {name!r} version {version!r} is not deployed (live: {live})")
