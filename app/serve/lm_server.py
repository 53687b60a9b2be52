"""One language model's replica state: a verified artifact's ONNX Runtime session generating
text (app/export/generate.py), at most `serve.generation.max_streams` generations at once.

`generate` is an async generator of typed events (app/serve/types.py), the contract between the
HTTP routes and the replica (local call or a streaming DeploymentHandle): `Started`, a `Piece`
per piece of text, `Finished`; a refusal (bad prompt, too many streams) is a `RequestError`
raised before the first event. Each model step runs on a worker thread, one step per piece
asked for, so when the consumer stops (the client disconnected and Serve cancelled the request)
the generation stops at the step in flight.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from app.config import ServeConfig
from app.export.artifact import Artifact, open_artifact
from app.export.generate import Generation, Generator, PromptError, SamplingParams
from app.serve.model_server import model_info
from app.serve.types import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    InferRequest,
    ModelInfo,
    Piece,
    RequestError,
    Started,
)

log = logging.getLogger("ray.serve")
_END = object()


class LMServer:
    def __init__(self, artifact_uri: str, cfg: ServeConfig):
        self.artifact: Artifact = open_artifact(artifact_uri)
        self.cfg = cfg
        self.threads = max(1, math.floor(cfg.replica_cpus))
        self.variant = cfg.variant
        self.generator = self._generator(self.variant)
        self.pool = ThreadPoolExecutor(cfg.generation.max_streams, thread_name_prefix="generate")
        # What this replica did, for metadata (and the disconnect test): generations running now,
        # finished by reason, and tokens generated in all.
        self.stats: dict[str, int] = {"active": 0, "tokens": 0, "completed": 0, "cancelled": 0}
        log.info("language model %s version %s loaded", self.artifact.name, self.artifact.version)

    def _generator(self, variant: str) -> Generator:
        return Generator.from_artifact(
            self.artifact,
            variant,
            self.threads,
            max_prompt_tokens=self.cfg.generation.max_prompt_tokens,
        )

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        variant = user_config.get("variant", "int8")
        if variant not in self.artifact.models:
            raise ValueError(f"variant: {variant!r} is not one of {sorted(self.artifact.models)}")
        if variant != self.variant:
            self.generator, self.variant = self._generator(variant), variant

    async def check_health(self) -> None:
        loop = asyncio.get_running_loop()
        ids = self.generator.encode("\n")
        params = SamplingParams(max_tokens=1, temperature=0)
        await loop.run_in_executor(self.pool, lambda: self.generator.generate(ids, params).text())

    async def info(self) -> ModelInfo:
        return model_info(self.artifact, self.variant, generation=dict(self.stats))

    async def infer(self, request: InferRequest) -> Any:
        raise RequestError(
            400, f"model {self.artifact.name!r} generates text: POST /v1/completions"
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """A generation's events; the request was validated by app.serve.completions."""
        if self.stats["active"] >= self.cfg.generation.max_streams:
            raise RequestError(
                503,
                f"model {self.artifact.name!r} is running serve.generation.max_streams="
                f"{self.cfg.generation.max_streams} generations; retry later",
                retry_after_s=1,
            )
        try:
            ids = self.generator.encode(request.prompt, request.field)
        except PromptError as e:
            raise RequestError(400, str(e)) from None
        generation = self.generator.generate(ids, SamplingParams(**request.params))
        self.stats["active"] += 1
        try:
            yield Started(prompt_tokens=len(ids), version=self.artifact.version)
            async for piece in self._pieces(generation):
                yield Piece(piece)
            yield self._end(generation)
            self.stats["completed"] += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.stats["cancelled"] += 1
            raise
        finally:
            generation.close()
            self.stats["active"] -= 1
            self.stats["tokens"] += generation.completion_tokens

    async def _pieces(self, generation: Generation) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        while True:
            piece = await loop.run_in_executor(self.pool, next, generation, _END)
            if piece is _END:
                return
            yield cast(str, piece)

    def _end(self, generation: Generation) -> Finished:
        return Finished(
            finish_reason=str(generation.finish_reason),
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=generation.completion_tokens,
            version=self.artifact.version,
        )
