"""A vector index's routes: `POST /v1/models/{name}:search`, `GET /v1/models/{name}/thumbnails/{id}`
and the search page (`GET /search`: plain HTML and a script, no data in it; pages/)."""

from __future__ import annotations

import base64
import binascii
import json
from functools import cache
from importlib import resources
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.encoders import jsonable_encoder

from app.runtime.types import SearchQuery, SearchRequest, bad
from app.serve.http.gate import body
from app.serve.http.protocol import read
from app.serve.http.routes.common import config, models
from app.tasks.index.http.protocol import SearchBody
from app.tasks.retrieval.http.protocol import data_url_bytes

router = APIRouter()
SEARCH = "/v1/models/{name}:search"


def search_route(name: str) -> str:
    return SEARCH.format(name=name)


@router.post(SEARCH)
async def search(name: str, request: Request) -> Response:
    parsed: SearchBody = read(await body(request), SearchBody, config(request))
    queries = tuple(search_query(q, i) for i, q in enumerate(parsed.all_queries()))
    conditions = tuple(sorted((parsed.filter or {}).items()))
    result = await models(request).search(name, SearchRequest(queries, parsed.top_k, conditions))
    answer = {
        "model": name,
        "version": result.version,
        "encoder_version": result.encoder_version,
        "results": result.hits,
    }
    # Plain JSON types throughout: written directly, not walked by FastAPI's encoder (half a
    # millisecond of a 10-hit answer); anything else a stored column holds goes through it.
    content = json.dumps(answer, separators=(",", ":"), default=jsonable_encoder).encode()
    headers = {"x-model-replica": str(result.replica_pid)}
    return Response(content, media_type="application/json", headers=headers)


def search_query(query: Any, i: int) -> SearchQuery:
    if query.image is not None:
        try:
            return SearchQuery(image=data_url_bytes(query.image, f"queries[{i}].image"))
        except ValueError as e:
            raise bad(str(e)) from None
    item = str(query.id) if query.id is not None else None
    return SearchQuery(text=query.text, embedding=embedding_of(query.embedding, i), id=item)


def embedding_of(value: list[Any] | str | None, i: int) -> np.ndarray | None:
    """A query's raw embedding: numbers as they are, base64 as little-endian float32."""
    if value is None or not isinstance(value, str):
        return None if value is None else np.asarray(value, np.float64)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"queries[{i}].embedding: the base64 data does not decode") from None
    if not data or len(data) % 4:
        raise bad(f"queries[{i}].embedding: {len(data)} bytes, not a float32 vector")
    return np.frombuffer(data, "<f4")


@router.get("/v1/models/{name}/thumbnails/{item:path}")
async def thumbnail(name: str, item: str, request: Request):
    data = await models(request).thumbnail(name, item)
    cached = {"cache-control": "private, max-age=3600"}
    return Response(data, media_type="image/jpeg", headers=cached)


# The page's own origin only; thumbnails arrive as blob: URLs fetched with the API key.
PAGE_POLICY = (
    "default-src 'none'; script-src 'self'; connect-src 'self'; img-src 'self' blob:; "
    "style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGES = {"/search": ("search.html", "text/html"), "/search.js": ("search.js", "text/javascript")}


@router.get("/search")
@router.get("/search.js")
async def page(request: Request):
    file, media = PAGES[request.url.path]
    headers = {"content-security-policy": PAGE_POLICY, "x-content-type-options": "nosniff"}
    return Response(page_text(file), media_type=f"{media}; charset=utf-8", headers=headers)


@cache
def page_text(file: str) -> str:
    return resources.files("app.tasks.index.http").joinpath("pages", file).read_text("utf-8")
