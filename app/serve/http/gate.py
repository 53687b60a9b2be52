"""What every request passes on its way in, before a route's own work: the one plain-ASGI
middleware (`Gate`: the mount prefix dropped, the request id, the API key and the declared body
size checked before the app sees the request, request metrics, and the last line of defence: a
crash becomes a JSON 500, never a plain-text page), and the body a route reads (`body`: counted
as it arrives within serve.max_body_bytes, its JSON values bounded by what the model's rows
could hold before any of it is parsed, then parsed as strict JSON by `parse_json`). One class
of middleware, so a request passes one frame of it, not one per job.

Plain ASGI rather than Starlette's `BaseHTTPMiddleware`, which runs the rest of the app in a
task group of its own with memory streams for every request.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Container, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from app.config import ServeConfig
from app.runtime.types import RequestError, bad
from app.serve.metrics import Deferred, MetricBuffer, model_counter, model_histogram

if TYPE_CHECKING:  # FastAPI's Request is Starlette's: the generation codecs import this module
    from starlette.requests import Request

log = logging.getLogger("ray.serve")
PUBLIC_PATHS = ("/v2/health/live", "/v2/health/ready", "/search", "/search.js")
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


class IngressMetrics:
    """Requests and latency by *model*: Serve's own request metrics are per application, and the
    index application answers v1 predictions for every model. Recorded by the metrics flush
    thread, off the request path."""

    def __init__(self, buffer: MetricBuffer | None = None) -> None:
        self.requests = model_counter(
            "raytorch_requests_total", "HTTP requests by model and status", ("model", "code")
        )
        self.latency = model_histogram(
            "raytorch_request_latency_ms",
            "request latency (ms)",
            [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000],
        )
        self.answered = Deferred(self._record, buffer)

    def observe(self, model: str, code: int, latency_ms: float) -> None:
        self.answered.append((model, code, latency_ms))

    def _record(self, buffer: MetricBuffer, answer: tuple[str, int, float]) -> None:
        model, code, latency_ms = answer
        tags = {"model": model}
        buffer.inc_and_observe(
            self.requests, tags | {"code": str(code)}, self.latency, latency_ms, tags
        )


# --- JSON ---------------------------------------------------------------------------------------


def _no_constants(token: str) -> float:
    raise ValueError(f"{token} is not allowed (numbers must be finite)")


def parse_json(body: bytes, what: str = "body") -> Any:
    if not body.strip():
        raise bad(f"{what}: empty; expected a JSON object")
    try:
        return json.loads(body, parse_constant=_no_constants)
    except RecursionError:
        raise bad(f"{what}: JSON nested too deeply") from None
    except UnicodeDecodeError:
        raise bad(f"{what}: not UTF-8 text") from None
    except ValueError as e:
        raise bad(f"{what}: not valid JSON ({str(e).splitlines()[0][:120]})") from None


# --- bounding a JSON body before it is parsed ---------------------------------------------------
# Parsing costs what a body holds, not what its rows need (2 million numbers take 80 ms, a
# million empty lists 380 ms and 86 MiB): a body is refused while it arrives, once what has
# arrived holds more items than the model's rows could.

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
ENVELOPE_ITEMS = 1024  # the request object, its parameters and outputs, around the rows

Text = bytes | bytearray


def json_items(text: Text) -> int:
    """Commas and opening brackets: at least the number of values and members a JSON text
    holds (those inside strings included), counted at memory speed without parsing."""
    return text.count(b",") + text.count(b"[") + text.count(b"{")


def max_json_items(inputs: list[dict[str, Any]], max_rows: int) -> int | None:
    """The most items a body of `max_rows` rows of this input can hold: each of a row's values
    may come in an array of its own, each row in one more (None: a row's size is not fixed)."""
    dims = inputs[0]["shape"][1:] if inputs else [-1]
    if any(d < 0 for d in dims):
        return None
    return max_rows * (2 * math.prod(dims) + 2) + ENVELOPE_ITEMS


def holds_more_items(text: Text, max_items: int) -> bool:
    """Whether a JSON body, or the part of it that has arrived, holds more than `max_items`."""
    items = json_items(text)
    if items <= max_items:  # the common case: one pass, no copy
        return False
    # A string is at least half an item (a key and its value): many strings alone are enough.
    quotes = text.count(b'"')
    if quotes > 4 * max_items + 2 and (quotes - text.count(b'\\"')) // 4 > max_items + 1:
        return True
    end = 0
    for string in _STRING.finditer(text):  # commas and brackets inside strings do not count
        items, end = items - json_items(string.group()), string.end()
        if items <= max_items:
            return False
    still_arriving = text.find(b'"', end)  # a string the part that has arrived cuts short
    if still_arriving >= 0:
        items -= json_items(text[still_arriving:])
    return items > max_items


@dataclass(slots=True)
class ItemGuard:
    """A JSON body's items counted as its chunks arrive (`body` adds each chunk's
    `json_items`): once the raw count passes `max_items` (and each time it doubles after that)
    `check` makes the exact count, strings set apart, and refuses the body (413) as soon as
    what has arrived holds more than `max_items`."""

    max_items: int
    items: int = 0  # commas and brackets so far, those inside strings included
    checked: int = 0  # the raw count at the last exact count

    def check(self, received: Text) -> None:
        if holds_more_items(received, self.max_items):
            raise bad(f"body: holds more than {self.max_items} JSON values for this model", 413)
        self.checked = self.items


def check_content_type(content_type: str | None, binary: bool) -> None:
    """JSON, or octet-stream with the binary extension; a missing Content-Type reads as JSON."""
    if not content_type:
        return
    media = content_type.split(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return
    if binary and media == "application/octet-stream":
        return
    raise bad(f"Content-Type {media!r} is not supported; send application/json", 415)


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
