"""A retrieval model's replica: its two encoders (ONNX Runtime) embed texts and pictures.

`embed` takes the items of one request in order, texts and pictures mixed. Every picture's
header is checked before any is decoded (`serve.max_image_pixels`, `serve.max_image_aspect`, and
`serve.max_request_pixels` for the request's pictures together), so a request over a limit costs
no decoding; a picture that fails is a 4xx naming its place in the request, and only that
request fails. Each graph runs once a request on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from ray import serve

from app.config import ServeConfig
from app.data.kinds.image_text import BadPicture, ImageText, PictureLimits, blank_png, require
from app.runtime.artifact import Artifact
from app.runtime.types import EmbedRequest, EmbedResult, RequestError
from app.serve.metrics import RetrievalMetrics
from app.serve.replicas.apps import SelfServing
from app.serve.replicas.base import Replica

log = logging.getLogger("ray.serve")
OUTPUT = "embedding"


class Encoders:
    """An artifact's two encoders as ONNX Runtime sessions of one variant."""

    def __init__(self, artifact: Artifact, variant: str, threads: int):
        self.pre: ImageText = require(artifact.preprocessor)
        self.image = artifact.session(variant, threads, "image")
        self.text = artifact.session(variant, threads, "text")

    def embed(
        self,
        items: tuple[str | bytes, ...],
        field: str,
        limits: PictureLimits,
        places: Sequence[str] | None = None,
    ) -> tuple[np.ndarray, int]:
        """Embeddings of `items` in order, and the text tokens read. A refusal names item i
        `field[i]`, or `places[i]` when given."""
        texts = [i for i, item in enumerate(items) if isinstance(item, str)]
        pictures = [i for i, item in enumerate(items) if isinstance(item, bytes)]
        pixels = self._pixels(items, pictures, field, limits, places) if pictures else None
        out: np.ndarray | None = None
        tokens = 0
        if texts:
            inputs = self.pre.text_features([str(items[i]) for i in texts])
            tokens = int(inputs["attention_mask"].sum())
            out = place(out, texts, self.text.run([OUTPUT], inputs)[0], len(items))
        if pixels is not None:
            out = place(out, pictures, self.image.run([OUTPUT], pixels)[0], len(items))
        assert out is not None
        return out, tokens

    def _pixels(
        self,
        items: tuple[str | bytes, ...],
        pictures: list[int],
        field: str,
        limits: PictureLimits,
        places: Sequence[str] | None,
    ) -> dict[str, np.ndarray]:
        """The pictures' pixels, every one checked before any text is encoded."""
        try:
            data = [item for i in pictures if isinstance(item := items[i], bytes)]
            return self.pre.image_features(data, limits)
        except BadPicture as e:
            named = places or [f"{field}[{i}]" for i in range(len(items))]
            where = _where(str(e), field, [named[i] for i in pictures])
            raise RequestError(e.status, where) from None


def place(out: np.ndarray | None, rows: list[int], values: np.ndarray, total: int) -> np.ndarray:
    if out is None:
        out = np.zeros((total, values.shape[1]), np.float32)
    out[rows] = values
    return out


def _where(message: str, field: str, pictures: list[str]) -> str:
    """ "[k]: why" (the k-th picture) -> "input[i]: why" (its place in the request); a refusal
    of the pictures together names the field."""
    if not message.startswith("["):
        return f"{field}: {message}"
    k, why = message[1:].split("]: ", 1)
    return f"{pictures[int(k)]}: {why}"


def picture_limits(cfg: ServeConfig) -> PictureLimits:
    """The limits a request's pictures are checked against, named by their config keys."""
    return PictureLimits(
        cfg.max_image_pixels,
        cfg.max_image_aspect,
        cfg.max_request_pixels,
        "serve.max_image_pixels",
        "serve.max_image_aspect",
        "serve.max_request_pixels",
    )


class EmbeddingServer(Replica):
    ROUTE = "embeds: POST /v1/embeddings"

    def __init__(self, artifact_uri: str, cfg: ServeConfig):
        super().__init__(artifact_uri, cfg)  # the artifact, its variant's encoders (`load`)
        self.limits = picture_limits(cfg)
        self.pool = ThreadPoolExecutor(
            cfg.batching.max_concurrent_batches, thread_name_prefix="onnx"
        )
        self.metrics = RetrievalMetrics(self.artifact.name)

    def describe(self) -> str:
        return f"retrieval model {self.artifact.name}"

    def load(self, variant: str) -> None:
        self.encoders = Encoders(self.artifact, variant, self.threads)

    async def check_health(self) -> None:
        await self._embedded(EmbedRequest(("health check", blank_png(8))))

    def details(self) -> dict[str, Any]:
        return {"embeds": True}

    async def embed(self, request: EmbedRequest) -> EmbedResult:
        started = time.perf_counter()
        result = await self._embedded(request)
        self.metrics.observe(len(request.items), 1000 * (time.perf_counter() - started))
        return result

    async def _embedded(self, request: EmbedRequest) -> EmbedResult:
        loop = asyncio.get_running_loop()
        embeddings, tokens = await loop.run_in_executor(
            self.pool, self.encoders.embed, request.items, request.field, self.limits
        )
        return EmbedResult(embeddings, tokens, self.artifact.version, os.getpid())


@serve.ingress()
class EmbeddingApp(SelfServing, EmbeddingServer):
    """A retrieval model's replica: the same routes, embeddings of texts and pictures."""
