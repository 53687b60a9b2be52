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
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.config import ServeConfig
from app.export.artifact import Artifact, open_artifact
from app.export.generate import Generation, Generator, PromptError, SamplingParams
from app.serve.chat import from_preprocessor as chat_template
from app.serve.decode_loop import DecodeLoop, LoopGeneration
from app.serve.metric_buffer import model_counter, model_gauge, model_histogram, process_buffer
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


class LMServer:
    def __init__(self, artifact_uri: str, cfg: ServeConfig):
        self.artifact: Artifact = open_artifact(artifact_uri)
        self.cfg = cfg
        self.threads = max(1, math.floor(cfg.replica_cpus))
        self.variant = cfg.variant
        self.generator = self._generator(self.variant)
        self.loop = self._decode_loop()
        self.pool = ThreadPoolExecutor(cfg.generation.max_streams, thread_name_prefix="generate")
        # What this replica did, for metadata (and the disconnect test): generations running now,
        # finished by reason, and tokens generated in all.
        self.stats: dict[str, int] = {
            "active": 0,
            "tokens": 0,
            "completed": 0,
            "cancelled": 0,
            "kv_cache_tokens": 0,  # prompt and generated tokens the running streams' caches hold
        }
        self._metrics = _GenerationMetrics(self.artifact.name)
        self.kv_budget = KVBudget(cfg.generation.max_kv_cache_mib, self.generator.decoder)
        self.chat = chat_template(self.artifact.preprocessor.state)
        log.info("language model %s version %s loaded", self.artifact.name, self.artifact.version)

    def _generator(self, variant: str) -> Generator:
        return Generator.from_artifact(
            self.artifact,
            variant,
            self.threads,
            max_prompt_tokens=self.cfg.generation.max_prompt_tokens,
        )

    def _decode_loop(self) -> DecodeLoop | None:
        """Continuous batching, where the config asks for it and the graph can batch streams
        (artifacts exported before it could step one stream at a time)."""
        if not (self.cfg.generation.continuous_batching and self.generator.decoder.batched):
            return None
        return DecodeLoop(self.generator)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        variant = user_config.get("variant", "int8")
        if variant not in self.artifact.models:
            raise ValueError(f"variant: {variant!r} is not one of {sorted(self.artifact.models)}")
        if variant != self.variant:
            self.generator, self.variant = self._generator(variant), variant
            if self.loop is not None:  # its streams finish on the old session
                self.loop.close()
            self.loop = self._decode_loop()

    async def check_health(self) -> None:
        loop = asyncio.get_running_loop()
        ids = self.generator.encode("\n")
        params = SamplingParams(max_tokens=1, temperature=0)
        await loop.run_in_executor(self.pool, lambda: self.generator.generate(ids, params).text())

    async def info(self) -> ModelInfo:
        batching = dict(self.loop.stats) if self.loop is not None else {"batch_peak": 1}
        return model_info(self.artifact, self.variant, generation=self.stats | batching)

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
        prompt = self.chat.render(request.messages) if request.messages else request.prompt
        try:
            ids = self.generator.encode(prompt, request.field)
        except PromptError as e:
            raise RequestError(400, str(e)) from None
        params = SamplingParams(**request.params)
        need = len(ids) + min(params.max_tokens, self.generator.block_size - len(ids))
        self.kv_budget.reserve(need, self.artifact.name)
        generation: Generation | LoopGeneration = (
            self.loop.submit(ids, params)
            if self.loop is not None
            else self.generator.generate(ids, params)
        )
        timing = _Timing()
        self._hold(1, len(ids))
        held = len(ids)  # the tokens this stream's cache holds, as last counted
        try:
            yield Started(prompt_tokens=len(ids), version=self.artifact.version)
            async for piece in self._pieces(generation):
                timing.token_came()
                self._hold(0, len(ids) + generation.completion_tokens - held)
                held = len(ids) + generation.completion_tokens
                yield piece
            yield self._end(generation)
            self.stats["completed"] += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.stats["cancelled"] += 1
            raise
        finally:
            generation.close()
            self.kv_budget.release(need)
            self._hold(-1, -held)
            self.stats["tokens"] += generation.completion_tokens
            self._metrics.observe(timing, generation.completion_tokens)

    def _hold(self, streams: int, tokens: int) -> None:
        """Streams and cached tokens now, in the stats and the gauges: a stream waits until its
        prompt is in its cache (the decode loop's prefill), then runs."""
        self.stats["active"] += streams
        self.stats["kv_cache_tokens"] += tokens
        waiting = self.loop.waiting_count() if self.loop is not None else 0
        self._metrics.levels(self.stats["active"] - waiting, waiting, self.stats["kv_cache_tokens"])

    async def _pieces(self, generation: Generation | LoopGeneration) -> AsyncIterator[Piece]:
        if isinstance(generation, LoopGeneration):  # the decode loop hands the text over
            async for piece in generation:
                yield piece
            return
        loop = asyncio.get_running_loop()
        while True:
            step: Piece | None = await loop.run_in_executor(self.pool, _next_piece, generation)
            if step is None:
                return
            yield step

    def _end(self, generation: Generation | LoopGeneration) -> Finished:
        return Finished(
            finish_reason=str(generation.finish_reason),
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=generation.completion_tokens,
            version=self.artifact.version,
        )


def _next_piece(generation: Generation) -> Piece | None:
    """One model step on a worker thread: the next piece, or None at the end."""
    text = next(generation, None)
    return None if text is None else Piece(text, generation.logprobs)


class KVBudget:
    """The KV-cache memory running streams may come to hold, each reserved at its most (prompt
    plus the tokens it may generate) when it starts, within serve.generation.max_kv_cache_mib."""

    def __init__(self, limit_mib: float | None, decoder: Any):
        self.limit = None if limit_mib is None else limit_mib * 2**20
        # A float32 key and value per layer, head and position.
        self.bytes_per_token = 2 * decoder.layers * decoder.heads * decoder.head_dim * 4
        self.reserved = 0

    def reserve(self, tokens: int, model: str) -> None:
        size = tokens * self.bytes_per_token
        if self.limit is None:
            self.reserved += size
            return
        mib = f"serve.generation.max_kv_cache_mib={self.limit / 2**20:g}"
        if size > self.limit:
            raise RequestError(
                400, f"prompt + max_tokens need {size / 2**20:.1f} MiB of KV cache, over {mib}"
            )
        if self.reserved + size > self.limit:
            raise RequestError(
                503,
                f"model {model!r} has its KV cache ({mib}) in use; retry later",
                retry_after_s=1,
            )
        self.reserved += size

    def release(self, tokens: int) -> None:
        self.reserved -= tokens * self.bytes_per_token


class _Timing:
    """When a generation started and produced its first and latest piece."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def token_came(self) -> None:
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last


class _GenerationMetrics:
    """What Serve's request metrics cannot see inside a stream (vLLM's names for them): the time
    to the first token, the time per output token after it, and the streams running and tokens
    held in KV caches now."""

    def __init__(self, model: str):
        self.tags = {"model": model}
        self.ttft = model_histogram(
            "raytorch_generation_ttft_ms",
            "time from a generation's start to its first text (ms)",
            [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000],
        )
        self.tpot = model_histogram(
            "raytorch_generation_tpot_ms",
            "time per output token after the first, per generation (ms)",
            [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000],
        )
        self.tokens = model_counter("raytorch_generation_tokens_total", "tokens generated")
        self.running = model_gauge("raytorch_generation_running", "generations decoding")
        self.waiting = model_gauge(
            "raytorch_generation_waiting", "generations admitted, their prompt not yet in cache"
        )
        self.kv_tokens = model_gauge(
            "raytorch_generation_kv_cache_tokens",
            "tokens held in the running generations' KV caches",
        )

    def observe(self, timing: _Timing, tokens: int) -> None:
        if tokens:
            process_buffer().inc(self.tokens, self.tags, by=tokens)
        if timing.first is None:  # refused, cancelled or ended before any text
            return
        process_buffer().observe(self.ttft, 1000 * (timing.first - timing.start), self.tags)
        if tokens > 1 and timing.last is not None:
            tpot = 1000 * (timing.last - timing.first) / (tokens - 1)
            process_buffer().observe(self.tpot, tpot, self.tags)

    def levels(self, running: int, waiting: int, kv_tokens: int) -> None:
        process_buffer().set(self.running, running, self.tags)
        process_buffer().set(self.waiting, waiting, self.tags)
        process_buffer().set(self.kv_tokens, kv_tokens, self.tags)
