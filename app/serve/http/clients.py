"""How the HTTP routes reach the models: one `ModelClient` protocol, a local and a Ray
implementation, and `Models`, the name -> client directory that adds what every call needs
(404 for an unknown name, the request timeout, 503 for overload or a dead replica).

- `LocalModel`: the replica object in this process. A model's own application answers its
  routes this way, so its requests never leave the replica.
- `RayModel`: another Serve application's ingress, through its DeploymentHandle (the index
  application at `/` answers /v1/models, the ready probe and v1 predict across models).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol

from app.config import ServeConfig
from app.runtime.types import (
    EmbedRequest,
    EmbedResult,
    GenerationEvent,
    GenerationRequest,
    InferRequest,
    InferResult,
    ModelInfo,
    RequestError,
    SearchRequest,
    SearchResult,
)

INFO_FRESH_S = 1.0  # how stale the ready probe's and the generation check's view may be


class ModelClient(Protocol):
    """Each call returns an awaitable (or async iterator); one with a `cancel()` method is
    cancelled when the caller stops waiting for it."""

    def info(self) -> Awaitable[ModelInfo]: ...

    def infer(self, request: InferRequest) -> Awaitable[InferResult]: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]: ...

    def embed(self, request: EmbedRequest) -> Awaitable[EmbedResult]: ...

    def search(self, request: SearchRequest) -> Awaitable[SearchResult]: ...

    def thumbnail(self, item: str) -> Awaitable[bytes]: ...


class LocalModel:
    """A ClassifierServer or LMServer in this process: its own methods, bound (no call in between)."""

    def __init__(self, server: Any):
        self.info = server.info
        self.infer = getattr(server, "infer", None)
        self.generate = getattr(server, "generate", None)
        self.embed = getattr(server, "embed", None)
        self.search = getattr(server, "search", None)
        self.thumbnail = getattr(server, "thumbnail", None)


class RayModel:
    """Another application's ingress deployment, looked up on first use."""

    def __init__(self, app_name: str):
        self.app_name = app_name
        self._handle: Any = None

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

    def info(self) -> Awaitable[ModelInfo]:
        return self._get().info.remote()  # a DeploymentResponse: awaitable, cancellable

    def infer(self, request: InferRequest) -> Awaitable[InferResult]:
        return self._get().infer.remote(request)

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        return self._get().options(stream=True).generate.remote(request)

    def embed(self, request: EmbedRequest) -> Awaitable[EmbedResult]:
        return self._get().embed.remote(request)

    def search(self, request: SearchRequest) -> Awaitable[SearchResult]:
        return self._get().search.remote(request)

    def thumbnail(self, item: str) -> Awaitable[bytes]:
        return self._get().thumbnail.remote(item)


class Models:
    """The models an application answers for, by name."""

    def __init__(
        self, clients: dict[str, ModelClient], timeout_s: float = 30.0, max_request_rows: int = 1024
    ):
        self.clients = clients
        self.timeout_s = timeout_s
        self.max_request_rows = max_request_rows  # refused before the request is read whole
        self._infos: dict[str, tuple[float, ModelInfo]] = {}

    @classmethod
    def configured(cls, clients: dict[str, ModelClient], cfg: ServeConfig) -> Models:
        return cls(clients, cfg.request_timeout_s, cfg.max_request_rows)

    def get(self, name: str) -> ModelClient:
        client = self.clients.get(name)
        if client is None:
            raise RequestError(404, f"model {name!r} not found (deployed: {sorted(self.clients)})")
        return client

    async def info(self, name: str, fresh_within_s: float = 0.0) -> ModelInfo:
        """The model's info; with `fresh_within_s`, a copy at most that old is good enough."""
        seen = self._infos.get(name)
        if seen is not None and time.monotonic() - seen[0] <= fresh_within_s:
            return seen[1]
        info = await self._call(name, self.get(name).info())
        self._infos[name] = (time.monotonic(), info)
        return info

    async def infer(self, name: str, request: InferRequest) -> InferResult:
        client = self.clients.get(name) or self.get(name)  # get: the 404
        return await self._call(name, client.infer(request))

    async def embed(self, name: str, request: EmbedRequest) -> EmbedResult:
        if not (await self.info(name, INFO_FRESH_S)).embeds:
            raise RequestError(400, f"model {name!r} does not embed (not a retrieval model)")
        return await self._call(name, self.get(name).embed(request))

    async def search(self, name: str, request: SearchRequest) -> SearchResult:
        if not (await self.info(name, INFO_FRESH_S)).searches:
            raise RequestError(400, f"model {name!r} is not a vector index")
        return await self._call(name, self.get(name).search(request))

    async def thumbnail(self, name: str, item: str) -> bytes:
        if not (await self.info(name, INFO_FRESH_S)).searches:
            raise RequestError(400, f"model {name!r} is not a vector index")
        return await self._call(name, self.get(name).thumbnail(item))

    async def generate(
        self, name: str, request: GenerationRequest
    ) -> tuple[GenerationEvent, AsyncIterator[GenerationEvent]]:
        """A generation on model `name`: (its first event, the rest). The first event is awaited
        here, so a refusal (bad prompt, too many streams) is a plain error answer, never a stream
        that fails after its 200."""
        if not (await self.info(name, INFO_FRESH_S)).generates:
            raise RequestError(400, f"model {name!r} does not generate text")
        events = self.get(name).generate(request)
        try:
            first = await self._call(name, anext(events), what="start")
        except BaseException:
            await close_events(events)  # else the replica generates on, holding a stream slot
            raise
        return first, events

    async def _call(self, name: str, call: Awaitable[Any], what: str = "answer") -> Any:
        from ray.serve.exceptions import BackPressureError

        try:
            async with asyncio.timeout(self.timeout_s):  # no task of its own, as wait_for makes
                return await call
        except TimeoutError:
            cancel = getattr(call, "cancel", None)
            if cancel is not None:  # frees the replica's slot; the client has its answer
                cancel()
            raise RequestError(
                504,
                f"model {name!r} did not {what} within serve.request_timeout_s={self.timeout_s:g}",
            ) from None
        except BackPressureError:
            raise RequestError(
                503, f"model {name!r} is overloaded (queue full); retry later", retry_after_s=1
            ) from None
        except unavailable_errors() as e:
            if too_large_for_transport(e):  # retrying would fail the same way
                raise RequestError(
                    413,
                    f"model {name!r}: the request or its answer is larger than the cluster "
                    "passes between deployments (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH); "
                    "ask for fewer results",
                ) from None
            # The replica died (or none is up): Serve replaces it; say so at once, retryable.
            raise RequestError(
                503, f"model {name!r} is unavailable ({type(e).__name__}); retry later"
            ) from None


def too_large_for_transport(error: BaseException) -> bool:
    """Serve's gRPC transport refusing a message over its size limit (RESOURCE_EXHAUSTED)."""
    code = getattr(error, "code", None)
    return callable(code) and getattr(code(), "name", "") == "RESOURCE_EXHAUSTED"


async def close_events(events: Any) -> None:
    """Stop a generation whose client is gone: a local async generator is closed, a
    DeploymentHandle stream cancelled (Serve then cancels it in the replica)."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()
        return
    cancel = getattr(events, "cancel", None)
    if cancel is not None:
        cancel()


@functools.cache
def unavailable_errors() -> tuple[type[BaseException], ...]:
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
