"""OpenAI's `POST /v1/embeddings` for a retrieval model: texts and pictures alike, floats or
base64 (little-endian float32, what OpenAI's client asks for by default)."""

from __future__ import annotations

import base64
from typing import Any

from fastapi import APIRouter, Request, Response

from app.runtime.types import EmbedRequest, EmbedResult
from app.serve.http.gate import body
from app.serve.http.protocol import read
from app.serve.http.routes.common import config, models
from app.tasks.retrieval.http.protocol import EmbeddingsRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request, response: Response):
    parsed: EmbeddingsRequest = read(await body(request), EmbeddingsRequest, config(request))
    result = await models(request).embed(parsed.model, EmbedRequest(parsed.input))
    response.headers["x-model-replica"] = str(result.replica_pid)
    return embedding_list(parsed.model, result, parsed.encoding_format or "float")


def embedding_list(model: str, result: EmbedResult, encoding: str) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(row, encoding)}
        for i, row in enumerate(result.embeddings)
    ]
    usage = {"prompt_tokens": result.tokens, "total_tokens": result.tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _encoded(row: Any, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode()
    return row.astype(float).tolist()
