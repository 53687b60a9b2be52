"""A retrieval model's replica: its two encoders (ONNX Runtime) embed texts and pictures.

`embed` takes the items of one request in order, texts and pictures mixed; a picture that does
not decode (within `serve.max_image_pixels`) is a 4xx naming its place in the request, and only
that request fails. Each graph runs once a request on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from app.config import ServeConfig
from app.data.kinds.image_text import BadPicture, ImageText, blank_png, require
from app.runtime.artifact import Artifact, open_artifact
from app.runtime.types import EmbedRequest, EmbedResult, InferRequest, ModelInfo, RequestError
from app.serve.replicas.model_server import model_info

log = logging.getLogger("ray.serve")
OUTPUT = "embedding"


class Encoders:
    """An artifact's two encoders as ONNX Runtime sessions of one variant."""

    def __init__(self, artifact: Artifact, variant: str, threads: int):
        self.pre: ImageText = require(artifact.preprocessor)
        self.image = artifact.session(variant, threads, "image")
        self.text = artifact.session(variant, threads, "text")

    def embed(
        self, items: tuple[str | bytes, ...], field: str, max_pixels: int
    ) -> tuple[np.ndarray, int]:
        """Embeddings of `items` in order, and the text tokens read."""
        texts = [i for i, item in enumerate(items) if isinstance(item, str)]
        pictures = [i for i, item in enumerate(items) if isinstance(item, bytes)]
        out: np.ndarray | None = None
        tokens = 0
        if texts:
            inputs = self.pre.text_features([str(items[i]) for i in texts])
            tokens = int(inputs["attention_mask"].sum())
            out = place(out, texts, self.text.run([OUTPUT], inputs)[0], len(items))
        if pictures:
            try:
                data = [items[i] for i in pictures]
                inputs = self.pre.image_features(
                    [d for d in data if isinstance(d, bytes)], max_pixels
                )
            except BadPicture as e:  # "[k]: why": the k-th picture of the request
                k, why = str(e)[1:].split("]: ", 1)
                raise RequestError(_status(why), f"{field}[{pictures[int(k)]}]: {why}") from None
            out = place(out, pictures, self.image.run([OUTPUT], inputs)[0], len(items))
        assert out is not None
        return out, tokens


def place(out: np.ndarray | None, rows: list[int], values: np.ndarray, total: int) -> np.ndarray:
    if out is None:
        out = np.zeros((total, values.shape[1]), np.float32)
    out[rows] = values
    return out


def _status(why: str) -> int:
    return 413 if "pixels, more than" in why else 400


class EmbeddingServer:
    def __init__(self, artifact_uri: str, cfg: ServeConfig):
        self.artifact = open_artifact(artifact_uri)
        self.cfg = cfg
        self.threads = max(1, math.floor(cfg.replica_cpus))
        self.variant = self.artifact.choose_variant(cfg.variant)
        self.encoders = Encoders(self.artifact, self.variant, self.threads)
        self.pool = ThreadPoolExecutor(
            cfg.batching.max_concurrent_batches, thread_name_prefix="onnx"
        )
        log.info("retrieval model %s version %s loaded", self.artifact.name, self.artifact.version)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        variant = self.artifact.choose_variant(user_config.get("variant", "int8"))
        if variant != self.variant:
            self.encoders, self.variant = Encoders(self.artifact, variant, self.threads), variant

    async def check_health(self) -> None:
        request = EmbedRequest(("health check", blank_png(8)))
        await self.embed(request)

    async def info(self) -> ModelInfo:
        return model_info(self.artifact, self.variant, embeds=True)

    async def infer(self, request: InferRequest) -> Any:
        raise RequestError(400, f"model {self.artifact.name!r} embeds: POST /v1/embeddings")

    async def embed(self, request: EmbedRequest) -> EmbedResult:
        loop = asyncio.get_running_loop()
        encoders, limit = self.encoders, self.cfg.max_image_pixels
        embeddings, tokens = await loop.run_in_executor(
            self.pool, encoders.embed, request.items, request.field, limit
        )
        return EmbedResult(embeddings, tokens, self.artifact.version)
