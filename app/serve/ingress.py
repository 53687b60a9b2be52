"""The HTTP API: Open Inference Protocol v2 and a simple JSON API over the model replicas.

Routes (README.md, "The HTTP API"): /v2, /v2/health/{live,ready}, /v2/models/{name}[/ready|/infer]
(also under /versions/{version}), /v1/models, /v1/models/{name}:predict.
Every error is a JSON body naming the problem: {"error": ...}; never a traceback, never a 500
for bad input; 413 for oversize bodies or too many rows, 503 when the model's bounded queue is
full or its replica died, 504 when it does not answer within serve.request_timeout_s.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import logging
import os
import time
import uuid
from collections.abc import Callable, MutableMapping
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import __version__
from app.config import ServeConfig
from app.serve.completions import (
    DONE,
    CompletionEncoder,
    parse_completion,
    parse_generate,
    sse,
)
from app.serve.metric_buffer import process_buffer
from app.serve.protocol import (
    BINARY_HEADER,
    RequestError,
    check_content_type,
    claimed_rows,
    decode_v1,
    decode_v2,
    encode_v2,
)
from app.tasks.registry import task_of_schema

log = logging.getLogger("ray.serve")
PUBLIC_PATHS = ("/v2/health/live", "/v2/health/ready")


UNKNOWN_HOST = "<unknown>"
# The metrics tag of a model name that is not deployed: one series, however many names are tried.
UNKNOWN_MODEL = "unknown"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_key(cfg: ServeConfig, serve_host: str | None = None) -> str | None:
    """The API key the model routes require, or None when they are open.

    The rule: when the environment variable named by `serve.api_key_env` is set (on the cluster),
    every route but the health probes needs `Authorization: Bearer <key>`, whatever the host. A
    key is *required* (no key: the ingress refuses to start, the deploy job refuses to deploy)
    whenever Serve may be reachable beyond loopback, that is when either host is not loopback:
    `serve_host`, where Serve's HTTP proxies really listen (`http_options.host` as the running
    controller has it: cluster/serve.yaml and the RayService set it there, not in `serve`), or
    `serve.host`. A host that could not be read (UNKNOWN_HOST) counts as public.
    `serve_host=None` means the caller has no such host to add (unit tests, before Serve runs).
    """
    key = os.environ.get(cfg.api_key_env) or None
    public = [h for h in (serve_host, cfg.host) if h is not None and not is_loopback(h)]
    if key is None and public:
        raise RuntimeError(
            f"Serve listens on {public[0]}, beyond loopback: set an API key in ${cfg.api_key_env} "
            "on the cluster (requests then need Authorization: Bearer <key>)"
        )
    return key


async def serve_http_host() -> str:
    """The host Serve's HTTP proxies listen on, read from the running Serve controller.

    Serve keeps the http_options it started with (later deploys cannot change them), so this is
    the one source of truth. Private API: if it cannot be read, UNKNOWN_HOST (fail closed).
    """
    try:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        options = await controller.get_http_config.remote()
        return str(options.host)
    except Exception as e:  # noqa: BLE001 - any failure means "unknown", handled as public
        log.warning("could not read Serve's HTTP host (%s); requiring an API key", e)
        return UNKNOWN_HOST


class ModelRouter:
    """What the routes need from the models: a name -> DeploymentHandle map plus error mapping."""

    def __init__(self, handles: dict[str, Any], timeout_s: float = 30.0):
        self.handles = handles
        self.timeout_s = timeout_s

    def get(self, name: str) -> Any:
        handle = self.handles.get(name)
        if handle is None:
            raise RequestError(404, f"model {name!r} not found (deployed: {sorted(self.handles)})")
        return handle

    def metrics_tag(self, name: str) -> str:
        # URL names are client-controlled: tagging with them would make unbounded series (and
        # Ray's metrics refuse non-ASCII tags outright).
        return name if name in self.handles else UNKNOWN_MODEL

    async def call(self, name: str, method: str, *args: Any) -> Any:
        from ray.serve.exceptions import BackPressureError

        handle = self.get(name)
        unavailable = _unavailable_errors()
        try:
            response = getattr(handle, method).remote(*args)
            return await asyncio.wait_for(_awaited(response), self.timeout_s)
        except asyncio.TimeoutError:
            _cancel(response)  # frees the replica's slot; the client has its answer
            raise RequestError(
                504,
                f"model {name!r} did not answer within serve.request_timeout_s={self.timeout_s:g}",
            ) from None
        except BackPressureError:
            raise RequestError(
                503, f"model {name!r} is overloaded (queue full); retry later"
            ) from None
        except unavailable as e:
            # The replica died (or none is up): Serve replaces it; say so at once, retryable.
            raise RequestError(
                503, f"model {name!r} is unavailable ({type(e).__name__}); retry later"
            ) from None

    async def stream(self, name: str, payload: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """A generation on model `name`: (the rest of its events, its first event). The first
        event is awaited here, so a refusal (bad prompt, too many streams) is a plain error
        answer, never a stream that fails after its 200."""
        from ray.serve.exceptions import BackPressureError

        handle = self.get(name)
        if not await self.generates(name, handle):
            raise RequestError(400, f"model {name!r} does not generate text")
        events = None
        try:
            events = handle.generate_stream.remote(payload)
            first = await asyncio.wait_for(events.__anext__(), self.timeout_s)
        except asyncio.TimeoutError:
            if events is not None:
                await close_events(events)  # else the replica generates on, holding a stream slot
            raise RequestError(
                504,
                f"model {name!r} did not start within serve.request_timeout_s={self.timeout_s:g}",
            ) from None
        except BackPressureError:
            raise RequestError(503, f"model {name!r} is overloaded; retry later") from None
        except _unavailable_errors() as e:
            raise RequestError(
                503, f"model {name!r} is unavailable ({type(e).__name__}); retry later"
            ) from None
        if "error" in first:
            await close_events(events)
            raise RequestError(first["status"], first["error"])
        return events, first

    async def generates(self, name: str, handle: Any) -> bool:
        """Whether model `name` is a language model. A replica's own handle knows; the index's
        handle on another application would accept any method name, so ask the model."""
        if not hasattr(handle, "generate_stream"):
            return False
        if not isinstance(handle, AppHandle):
            return True
        metadata = await self.call(name, "metadata")
        return task_of_schema(metadata.get("schema") or {}).generates


@functools.cache
def _unavailable_errors() -> tuple[type[BaseException], ...]:
    """What awaiting a replica raises when it died or none is up (503, not 500)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    errors: tuple[type[BaseException], ...] = (
        RayActorError,  # ActorDiedError, ActorUnavailableError
        ReplicaUnavailableError,
        DeploymentUnavailableError,
    )
    try:  # Serve's gRPC transport between deployments can surface its own transport error
        from grpc.aio import AioRpcError
    except ImportError:
        return errors
    return (*errors, AioRpcError)


async def close_events(events: Any) -> None:
    """Stop a generation whose client is gone: a local async generator is closed, a
    DeploymentHandle stream cancelled (Serve then cancels it in the replica)."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()
    else:
        _cancel(events)


class _LocalMethod:
    def __init__(self, fn: Any):
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)  # a coroutine: ModelServer's methods are async


class LocalHandle:
    """A ModelServer in this process, called the way ModelRouter calls a DeploymentHandle: the
    model application's own routes use it, so its requests never leave the replica."""

    def __init__(self, server: Any):
        self.infer = _LocalMethod(server.infer)
        self.metadata = _LocalMethod(server.metadata)
        if hasattr(server, "generate_stream"):  # a language model
            self.generate_stream = _LocalMethod(server.generate_stream)


class AppHandle:
    """The ingress deployment of another Serve application (a model's), looked up on first use:
    the index application answers /v1/models and /v2/health/ready across models with it."""

    def __init__(self, app_name: str):
        self.app_name = app_name
        self._handle: Any = None
        self.infer = _LocalMethod(lambda *a: self._get().infer.remote(*a))
        self.metadata = _LocalMethod(lambda *a: self._get().metadata.remote(*a))
        self.generate_stream = _LocalMethod(
            lambda *a: self._get().options(stream=True).generate_stream.remote(*a)
        )

    def _get(self) -> Any:
        if self._handle is None:
            from ray import serve

            try:
                self._handle = serve.get_app_handle(self.app_name)
            except Exception as e:  # noqa: BLE001 - not deployed (yet): retryable
                raise RequestError(
                    503, f"application {self.app_name!r} is not running ({type(e).__name__})"
                ) from None
        return self._handle


async def _awaited(response: Any) -> Any:
    return await response


def _cancel(response: Any) -> None:
    cancel = getattr(response, "cancel", None)
    if cancel is not None:
        cancel()


def error(status: int, message: str) -> JSONResponse:
    """Every error answer: a JSON body naming the problem."""
    return JSONResponse({"error": message}, status_code=status)


def create_api(
    cfg: ServeConfig,
    router: ModelRouter,
    metrics: Any = None,
    serve_host: str | None = None,
    under_serve: bool = False,
) -> FastAPI:
    """The HTTP API over `router`. `serve_host`: the host Serve listens on (the API key rule);
    `under_serve`: the app runs in a Serve replica, whose own middleware echoes the request id."""
    api = FastAPI(title="raytorch", version=__version__, docs_url=None, redoc_url=None)
    key = api_key(cfg, serve_host)
    # One line per answered request, with serve.access_log (Serve's own line follows it too).
    request_log_level = logging.INFO if cfg.access_log else logging.DEBUG

    def observe(scope: dict[str, Any], status: int, latency_ms: float) -> None:
        # Routing put the matched route's path parameters into this same scope (Guard).
        name = scope.get("path_params", {}).get("name")
        try:
            metrics.observe("-" if name is None else router.metrics_tag(name), status, latency_ms)
        except Exception:  # noqa: BLE001 - a metrics failure must never change the answer
            log.exception("could not record request metrics")

    api.add_middleware(
        Guard,
        key=key,
        max_body_bytes=cfg.max_body_bytes,
        observe=observe if metrics is not None else None,
        echo_request_id=not under_serve,
    )

    @api.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        log.info(
            "request %s: %d %s", getattr(request.state, "request_id", "-"), exc.status, exc.message
        )
        return error(exc.status, exc.message)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail))

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error(400, str(exc.errors()[0].get("msg", "invalid request")))

    async def body(request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                raise RequestError(413, f"body exceeds serve.max_body_bytes={cfg.max_body_bytes}")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_rows(n: int) -> None:
        if n > cfg.max_request_rows:
            raise RequestError(
                413, f"{n} rows exceed serve.max_request_rows={cfg.max_request_rows}"
            )

    async def model_metadata(name: str) -> dict[str, Any]:
        return await router.call(name, "metadata")

    # --- Open Inference Protocol v2 ---------------------------------------------------------

    @api.get("/v2")
    async def server_metadata():
        return {"name": "raytorch", "version": __version__, "extensions": ["binary_tensor_data"]}

    @api.get("/v2/health/live")
    async def live():
        return {"live": True}

    @api.get("/v2/health/ready")
    async def ready():
        try:
            await asyncio.gather(*(model_metadata(n) for n in router.handles))
        except Exception as e:  # noqa: BLE001 - not ready is an answer, not a crash
            return error(503, f"not ready: {type(e).__name__}")
        return {"ready": True}

    @api.get("/v2/models/{name}")
    @api.get("/v2/models/{name}/versions/{version}")
    async def v2_model(name: str, version: str | None = None):
        meta = await model_metadata(name)
        check_version(meta, version)
        schema = meta["schema"]
        return {
            "name": name,
            "versions": [meta["version"]],
            "platform": "onnxruntime_onnx",
            "inputs": schema["inputs"],
            "outputs": schema["outputs"],
            "parameters": {
                "labels": schema["labels"],
                "variant": meta["variant"],
                **({"generation": meta["generation"]} if "generation" in meta else {}),
            },
        }

    @api.get("/v2/models/{name}/ready")
    @api.get("/v2/models/{name}/versions/{version}/ready")
    async def v2_model_ready(name: str, version: str | None = None):
        meta = await model_metadata(name)
        check_version(meta, version)
        return {"name": name, "ready": True}

    @api.post("/v2/models/{name}/infer")
    @api.post("/v2/models/{name}/versions/{version}/infer")
    async def v2_infer(name: str, request: Request, version: str | None = None):
        router.get(name)
        header_length = request.headers.get(BINARY_HEADER)
        check_content_type(request.headers.get("content-type"), binary=header_length is not None)
        parsed = decode_v2(await body(request), header_length)
        # A first, cheap count; the replica counts again after flattening the data it reads.
        check_rows(claimed_rows(parsed["tensor"]))
        result = await infer(name, {"protocol": "v2", "tensor": parsed["tensor"]}, request)
        if version is not None and version != result["version"]:
            raise RequestError(
                404,
                f"model {name!r} version {version!r} is not deployed (live: {result['version']})",
            )
        content, headers = encode_v2(
            name,
            result["version"],
            parsed["id"],
            result["labels"],
            np.asarray(result["probabilities"]),
            parsed["binary_outputs"],
        )
        headers["x-model-replica"] = str(result["replica_pid"])
        return Response(content=content, headers=headers)

    # --- simple JSON ------------------------------------------------------------------------

    @api.get("/v1/models")
    async def v1_models():
        metas = await asyncio.gather(*(model_metadata(n) for n in sorted(router.handles)))
        return {
            "models": [
                {
                    k: m[k]
                    for k in ("name", "version", "variant", "artifact", "manifest", "batching")
                    if k in m  # batching: classifiers only (language models generate)
                }
                for m in metas
            ]
        }

    @api.post("/v1/models/{name}:predict")
    async def v1_predict(name: str, request: Request):
        router.get(name)
        check_content_type(request.headers.get("content-type"), binary=False)
        instances = decode_v1(await body(request))
        check_rows(len(instances))
        result = await infer(name, {"protocol": "v1", "instances": instances}, request)
        names = result["label_names"]
        return {
            "model_name": name,
            "model_version": result["version"],
            "predictions": [
                {"label": label, "probabilities": dict(zip(names, map(float, probs), strict=True))}
                for label, probs in zip(result["labels"], result["probabilities"], strict=True)
            ],
        }

    async def infer(name: str, payload: dict[str, Any], request: Request) -> dict[str, Any]:
        result = await router.call(name, "infer", payload)
        if "error" in result:
            raise RequestError(result["status"], result["error"])
        log.log(
            request_log_level,
            "request %s: model %s v%s %d rows",
            request.state.request_id,
            name,
            result["version"],
            len(result["labels"]),
        )
        return result

    # --- text generation (language models) --------------------------------------------------

    @api.post("/v1/completions")
    async def completions(request: Request):
        check_content_type(request.headers.get("content-type"), binary=False)
        parsed = parse_completion(await body(request), cfg)
        name = parsed["model"]
        events, _ = await router.stream(
            name, {"prompt": parsed["prompt"], "params": parsed["params"]}
        )
        encoder = CompletionEncoder(name)
        if not parsed["stream"]:
            text, end = await collect(events)
            return encoder.whole(text, end)

        async def chunks():
            async for event in events:
                if "text" in event:
                    yield sse(encoder.chunk(event["text"]))
                elif "end" in event:
                    yield sse(encoder.last_chunk(event["end"]))
            yield DONE

        return event_stream(events, chunks())

    @api.post("/v2/models/{name}/generate")
    @api.post("/v2/models/{name}/generate_stream")
    async def v2_generate(name: str, request: Request):
        router.get(name)
        check_content_type(request.headers.get("content-type"), binary=False)
        parsed = parse_generate(await body(request), cfg)
        payload = {"prompt": parsed["prompt"], "params": parsed["params"], "field": "text_input"}
        events, first = await router.stream(name, payload)
        version = first["start"]["version"]

        def answer(text: str, end: dict[str, Any] | None = None) -> dict[str, Any]:
            out = {"model_name": name, "model_version": version, "text_output": text}
            if end is not None:
                out |= {k: end[k] for k in ("finish_reason", "prompt_tokens", "completion_tokens")}
            return out

        if not request.url.path.endswith("/generate_stream"):
            text, end = await collect(events)
            return answer(text, end)

        async def chunks():
            async for event in events:
                if "text" in event:
                    yield sse(answer(event["text"]))
                elif "end" in event:
                    yield sse(answer("", event["end"]))

        return event_stream(events, chunks())

    async def collect(events: Any) -> tuple[str, dict[str, Any]]:
        pieces, end = [], None
        try:
            async for event in events:
                if "text" in event:
                    pieces.append(event["text"])
                elif "end" in event:
                    end = event["end"]
        finally:
            await close_events(events)
        if end is None:
            raise RequestError(500, "the generation ended without finishing; see the replica log")
        return "".join(pieces), end

    def event_stream(events: Any, chunks: Any) -> StreamingResponse:
        async def guarded():
            try:
                async for chunk in chunks:
                    yield chunk
            except Exception as e:  # noqa: BLE001 - after the 200: say so in the stream itself
                log.exception("generation stream failed")
                yield sse({"error": f"generation failed ({type(e).__name__})"})
            finally:  # the client left (cancelled) or the stream ended: stop the model
                await close_events(events)

        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return StreamingResponse(guarded(), media_type="text/event-stream", headers=headers)

    def check_version(meta: dict[str, Any], version: str | None) -> None:
        if version is not None and version != meta["version"]:
            raise RequestError(
                404,
                f"model {meta['name']!r} version {version!r} is not deployed (live: {meta['version']})",
            )

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_found(path: str):
        return error(404, f"no route /{path}")

    return api


class Guard:
    """The middleware of ours around every application: request id, API key, body size, the last
    line of defence against a crash (a JSON 500, never Starlette's plain-text page), and the
    request metrics (status, and latency to the start of the answer: a stream's first byte).

    Plain ASGI rather than Starlette's `BaseHTTPMiddleware`, which runs the rest of the app in a
    task group of its own with memory streams for every request: measured (wrk, digits), that was
    ~45% of the plain server's CPU per request (0.43 -> 0.24 ms) and 0.16 ms of the replica's.

    It also routes on the full request path, whatever prefix the application is mounted at: Serve
    hands an application mounted at `/v2/models/digits` the full path with that prefix as
    `root_path`, and Starlette would route on the rest (`/infer`). Each model's application is
    mounted at its own prefix (app.serve.app) yet answers the same public routes as the index at
    `/`, so the prefix is dropped before routing, in this same scope: routing writes the matched
    path parameters (the model name the metrics are tagged with) into the scope it is given.
    """

    def __init__(
        self,
        app: Any,
        key: str | None,
        max_body_bytes: int,
        observe: Callable[[dict[str, Any], int, float], None] | None,
        echo_request_id: bool = True,
    ):
        self.app, self.key, self.max_body_bytes = app, key, max_body_bytes
        self.observe = observe
        # Under Serve, its RequestIdMiddleware already adds X-Request-ID to every answer (the
        # same id: it put it in the request headers first); a second copy reads "id, id".
        self.echo_request_id = echo_request_id

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("root_path"):
            scope["root_path"] = ""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        tag = [(b"x-request-id", request_id.encode("latin-1"))] if self.echo_request_id else []
        answer: dict[str, Any] = {}  # status and latency, once the answer starts

        async def send_tagged(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answer.update(status=message["status"], ms=1000 * (time.perf_counter() - start))
                if tag:
                    message = {**message, "headers": [*message.get("headers", ()), *tag]}
            await send(message)

        refusal = self.refuse(scope["path"], headers)
        try:
            if refusal is not None:
                await refusal(scope, receive, send_tagged)
                return
            try:
                await self.app(scope, receive, send_tagged)
            except Exception:
                if answer:  # the answer has begun: nothing else can be sent (the server logs it)
                    raise
                log.exception("request %s failed", request_id)
                await error(500, "internal error; see the replica log")(scope, receive, send_tagged)
        finally:
            # A request cancelled before it was answered (the client went away) is not counted:
            # it has no status of ours, and Serve counts it (499) itself.
            if self.observe is not None and answer:
                self.observe(scope, answer["status"], answer["ms"])

    def refuse(self, path: str, headers: Headers) -> JSONResponse | None:
        """The answer to a request that must not reach the app (key, size), else None."""
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
        if length and length.isdigit() and int(length) > self.max_body_bytes:
            return error(
                413,
                f"body of {length} bytes exceeds serve.max_body_bytes={self.max_body_bytes}",
            )
        return None


class IngressMetrics:
    def __init__(self) -> None:
        from ray.util.metrics import Counter, Histogram

        self.requests = Counter(
            "raytorch_requests_total",
            description="HTTP requests by model and status",
            tag_keys=("model", "code"),
        )
        self.latency = Histogram(
            "raytorch_request_latency_ms",
            description="request latency (ms)",
            boundaries=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000],
            tag_keys=("model",),
        )

    def observe(self, model: str, code: int, latency_ms: float) -> None:
        process_buffer().inc(self.requests, {"model": model, "code": str(code)})
        process_buffer().observe(self.latency, latency_ms, {"model": model})
