"""What every route needs: the application's models and config, and the request body read
within serve.max_body_bytes."""

from __future__ import annotations

from fastapi import Request

from app.config import ServeConfig
from app.serve.clients import Models
from app.serve.protocol import check_content_type
from app.serve.types import RequestError


def models(request: Request) -> Models:
    return request.app.state.models


def config(request: Request) -> ServeConfig:
    return request.app.state.config


async def body(request: Request, binary: bool = False) -> bytes:
    """The body, counted as it arrives (a body sent without a length is bounded too)."""
    check_content_type(request.headers.get("content-type"), binary=binary)
    limit = config(request).max_body_bytes
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"body exceeds serve.max_body_bytes={limit}")
        chunks.append(chunk)
    return b"".join(chunks)
