"""The plain-ASGI middleware around every application, one job each, outermost first:

    Observe     request id, request metrics (status, latency to the answer's first byte), and
                the last line of defence: a crash becomes a JSON 500, never a plain-text page
    Admit       the API key and the declared body size, checked before the app sees the request
    FullPath    routes on the full path whatever prefix the application is mounted at

Plain ASGI rather than Starlette's `BaseHTTPMiddleware`, which runs the rest of the app in a
task group of its own with memory streams for every request.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import time
import uuid
from collections.abc import Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from app.config import ServeConfig

log = logging.getLogger("ray.serve")
PUBLIC_PATHS = ("/v2/health/live", "/v2/health/ready")
ASGIApp = Callable[..., Any]


def error(
    status: int, message: str, retry_after_s: int | None = None, path: str = ""
) -> JSONResponse:
    """Every error answer: a JSON body naming the problem; on OpenAI's routes in OpenAI's
    shape (`{"error": {"message", "type", "param", "code"}}`), which its clients parse."""
    headers = {"retry-after": str(retry_after_s)} if retry_after_s is not None else None
    body: dict[str, Any] = {"error": message}
    if path.endswith(OPENAI_ROUTES):
        field = message.split(":", 1)[0] if ":" in message else None
        kind = "invalid_request_error" if status < 500 else "server_error"
        param = field if field and " " not in field else None
        body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_key(cfg: ServeConfig, serve_host: str | None = None) -> str | None:
    """The API key the model routes require, or None when they are open.

    When the environment variable named by `serve.api_key_env` is set (on the cluster), every
    route but the health probes needs `Authorization: Bearer <key>`. A key is *required* (no key:
    the ingress refuses to start, the deploy job refuses to deploy) whenever Serve may be
    reachable beyond loopback: when `serve_host` (where Serve's HTTP proxies really listen, as
    the running controller has it) or `serve.host` is not loopback. A host that could not be
    read (app.ray_private.UNKNOWN_HOST) counts as public; `serve_host=None`: the caller has none to add.
    """
    key = os.environ.get(cfg.api_key_env) or None
    public = [h for h in (serve_host, cfg.host) if h is not None and not is_loopback(h)]
    if key is None and public:
        raise RuntimeError(
            f"Serve listens on {public[0]}, beyond loopback: set an API key in ${cfg.api_key_env} "
            "on the cluster (requests then need Authorization: Bearer <key>)"
        )
    return key


class FullPath:
    """Serve hands an application mounted at `/v2/models/digits` the full path with that prefix
    as `root_path`, and Starlette would route on the rest (`/infer`). Each model's application
    answers the same public routes as the index at `/`, so the prefix is dropped, in this same
    scope: routing writes the matched path parameters (the model name the metrics are tagged
    with) into the scope it is given."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("root_path"):
            scope["root_path"] = ""
        await self.app(scope, receive, send)


class Admit:
    """Refuses, before the app runs, a request without the API key or with a declared body
    over serve.max_body_bytes (a body sent without a length is counted as it is read)."""

    def __init__(self, app: ASGIApp, key: str | None, max_body_bytes: int):
        self.app, self.key, self.max_body_bytes = app, key, max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.refuse(scope["path"], Headers(scope=scope))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refuse(self, path: str, headers: Headers) -> JSONResponse | None:
        if self.key and path not in PUBLIC_PATHS:
            auth = headers.get("authorization", "")
            if not auth:
                return error(401, "missing Authorization: Bearer <api key>")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.key.encode()
            ):
                return error(403, "invalid API key")
        length = headers.get("content-length")
        # A length of thousands of digits is too large, and too long to convert.
        if length and length.isdigit() and (len(length) > 18 or int(length) > self.max_body_bytes):
            return error(413, f"body exceeds serve.max_body_bytes={self.max_body_bytes}")
        return None


def request_id(scope: Any) -> str:
    """The request's id for log lines: the one Observe echoes, else the client's or Serve's
    `x-request-id`, else "-"."""
    state = scope.get("state") or {}
    return state.get("request_id") or Headers(scope=scope).get("x-request-id") or "-"


class Observe:
    """Request id (`x-request-id`, echoed unless Serve's own middleware does), request metrics,
    and a JSON 500 for a crash before the answer began."""

    def __init__(
        self,
        app: ASGIApp,
        observe: Callable[[dict[str, Any], int, float], None] | None,
        echo_request_id: bool = True,
    ):
        self.app, self.observe, self.echo_request_id = app, observe, echo_request_id

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        # An id of our own only where we echo it (under Serve, Serve's middleware does).
        tag = self._request_id_header(scope) if self.echo_request_id else []
        answer: dict[str, Any] = {}  # status and latency, once the answer starts

        async def send_tagged(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answer.update(status=message["status"], ms=1000 * (time.perf_counter() - start))
                if tag:
                    message = {**message, "headers": [*message.get("headers", ()), *tag]}
            await send(message)

        try:
            await self.app(scope, receive, send_tagged)
        except Exception:
            if answer:  # the answer has begun: nothing else can be sent (the server logs it)
                raise
            log.exception("request %s failed", request_id(scope))
            await error(500, "internal error; see the replica log")(scope, receive, send_tagged)
        finally:
            # A request cancelled before it was answered (the client went away) is not counted:
            # it has no status of ours, and Serve counts it (499) itself.
            if self.observe is not None and answer:
                self.observe(scope, answer["status"], answer["ms"])

    @staticmethod
    def _request_id_header(scope: Any) -> list[tuple[bytes, bytes]]:
        rid = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        return [(b"x-request-id", rid.encode("latin-1"))]
