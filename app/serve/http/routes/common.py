"""What every route needs: the application's models and config, and the request body read
within serve.max_body_bytes."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from app.config import ServeConfig
from app.runtime.types import RequestError
from app.serve.http.clients import Models
from app.serve.http.protocol import ItemGuard, check_content_type, json_items, max_json_items


def models(request: Request) -> Models:
    return request.app.state.models


def config(request: Request) -> ServeConfig:
    return request.app.state.config


async def body(
    request: Request, binary: bool = False, inputs: list[dict[str, Any]] | None = None
) -> bytes:
    """The body, counted as it arrives (a body sent without a length is bounded too). With the
    model's `inputs`, a JSON body is refused as soon as what has arrived holds more values than
    serve.max_request_rows rows could, before the rest is read or any of it parsed (`ItemGuard`
    counts each chunk's items; the exact count runs only once they pass the bound)."""
    content_type = request.headers.get("content-type")
    if content_type and content_type != "application/json":
        check_content_type(content_type, binary=binary)
    cfg: ServeConfig = request.app.state.config
    max_items = None if binary or not inputs else max_json_items(inputs, cfg.max_request_rows)
    guard = ItemGuard(max_items) if max_items is not None else None
    received = bytearray()
    async for chunk in request.stream():
        if len(received) + len(chunk) > cfg.max_body_bytes:
            raise RequestError(413, f"body exceeds serve.max_body_bytes={cfg.max_body_bytes}")
        received += chunk
        if guard is not None:
            guard.items += json_items(chunk)
            if guard.items > max(guard.max_items, 2 * guard.checked):
                guard.check(received)
    # The whole body: its exact count if the raw one is over the bound and not counted yet.
    if guard is not None and guard.max_items < guard.items != guard.checked:
        guard.check(received)
    return bytes(received)
