"""The plain-ASGI middleware around every application (`Gate`): the mount prefix dropped, the
request id, the API key and the declared body size checked before the app sees the request,
request metrics, and the last line of defence: a crash becomes a JSON 500, never a plain-text
page. One class, so a request passes one frame of middleware, not one per job.

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
from collections.abc import Callable, Container, MutableMapping
from typing import Any, Protocol

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from app.config import ServeConfig

log = logging.getLogger("ray.serve")
PUBLIC_PATHS = ("/v2/health/live", "/v2/health/ready")
# The metrics tag of a model name that is not deployed: one series, however many names are tried.
UNKNOWN_MODEL = "unknown"
ASGIApp = Callable[..., Any]


class RequestMetrics(Protocol):
    def observe(self, model: str, code: int, latency_ms: float) -> None: ...


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


def request_id(scope: Any) -> str:
    """The request's id for log lines: the one Gate echoes, else the client's or Serve's
    `x-request-id`, else "-"."""
    state = scope.get("state") or {}
    return state.get("request_id") or Headers(scope=scope).get("x-request-id") or "-"


class Gate:
    """The one middleware: Serve hands an application mounted at `/v2/models/digits` the full
    path with that prefix as `root_path`, and each model's application answers the same public
    routes as the index at `/`, so the prefix is dropped in this same scope (routing writes the
    matched path parameters, the model name the metrics are tagged with, into the scope it is
    given). Then, for an HTTP request: its id (`x-request-id`, echoed unless Serve's own
    middleware does), the API key and declared body size checked before the app runs (a body
    sent without a length is counted as it is read), request metrics (status, latency to the
    answer's first byte) and a JSON 500 for a crash before the answer began."""

    def __init__(
        self,
        app: ASGIApp,
        key: str | None,
        max_body_bytes: int,
        metrics: RequestMetrics | None = None,
        models: Container[str] = (),
        echo_request_id: bool = True,
    ):
        self.app, self.key, self.max_body = app, key, max_body_bytes
        self.metrics, self.models, self.echo_request_id = metrics, models, echo_request_id

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("root_path"):
            scope["root_path"] = ""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = Headers(scope=scope)
        tag: list[tuple[bytes, bytes]] = []
        if self.echo_request_id:  # an id of our own only where we echo it
            rid = headers.get("x-request-id") or uuid.uuid4().hex
            scope.setdefault("state", {})["request_id"] = rid
            tag = [(b"x-request-id", rid.encode("latin-1"))]
        answer: dict[str, Any] = {}  # status and latency, once the answer starts

        async def send_tagged(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answer.update(status=message["status"], ms=1000 * (time.perf_counter() - start))
                if tag:
                    message = {**message, "headers": [*message.get("headers", ()), *tag]}
            await send(message)

        length = headers.get("content-length")
        try:
            refusal = self.key_refusal(scope["path"], headers) if self.key else None
            # A length of thousands of digits is too large, and too long to convert.
            if length and length.isdigit() and (len(length) > 18 or int(length) > self.max_body):
                refusal = refusal or error(
                    413, f"body exceeds serve.max_body_bytes={self.max_body}"
                )
            await (refusal or self.app)(scope, receive, send_tagged)
        except Exception:
            if answer:  # the answer has begun: nothing else can be sent (the server logs it)
                raise
            log.exception("request %s failed", request_id(scope))
            await error(500, "internal error; see the replica log")(scope, receive, send_tagged)
        finally:
            # A request cancelled before it was answered (the client went away) is not counted:
            # it has no status of ours, and Serve counts it (499) itself.
            if self.metrics is not None and answer:
                # Tagged by the model name routing put in the scope. URL names are the client's:
                # tags of them would make unbounded series (and Ray refuses non-ASCII tags).
                name = scope.get("path_params", {}).get("name")
                model = "-" if name is None else name if name in self.models else UNKNOWN_MODEL
                try:
                    self.metrics.observe(model, answer["status"], answer["ms"])
                except Exception:  # noqa: BLE001 - a metrics failure must never change the answer
                    log.exception("could not record request metrics")

    def key_refusal(self, path: str, headers: Headers) -> JSONResponse | None:
        if path in PUBLIC_PATHS or self.key is None:
            return None
        auth = headers.get("authorization", "")
        if not auth:
            return error(401, "missing Authorization: Bearer <api key>")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.key.encode()
        ):
            return error(403, "invalid API key")
        return None
