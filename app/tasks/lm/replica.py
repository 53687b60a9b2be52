"""One language model's replica state: a verified artifact's ONNX Runtime session generating
text in one decode loop (app/runtime/decode_loop.py), at most
`serve.generation.max_streams` generations at once.

`generate` is an async generator of typed events (app/runtime/types.py), the contract between the
HTTP routes and the replica (local call or a streaming DeploymentHandle): `Started`, a `Piece`
per piece of text, `Finished`; a refusal (bad prompt, too many streams) is a `RequestError`
raised before the first event, and a stream the model could not continue raises its
`RequestError` (500, or 503 for lack of memory) after the pieces it got. When the consumer stops
(the client disconnected and Serve cancelled the request) the stream leaves the batch at the
next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from ray import serve

from app.config import ServeConfig
from app.runtime.decode_loop import DecodeLoop, LoopGeneration
from app.runtime.decoding import Generator, PromptError, SamplingParams
from app.runtime.types import (
    FINISH_REASONS,
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    RequestError,
    Started,
)
from app.serve.metrics import (
    MetricBuffer,
    model_counter,
    model_gauge,
    model_histogram,
    process_buffer,
)
from app.serve.replicas.apps import SelfServing
from app.serve.replicas.base import Replica
from app.tasks.lm.chat import from_preprocessor as chat_template

log = logging.getLogger("ray.serve")
HEALTH_PROBE = SamplingParams(max_tokens=1, temperature=0)


class LMServer(Replica):
    ROUTE = "generates text: POST /v1/completions"

    def __init__(self, artifact_uri: str, cfg: ServeConfig):
        super().__init__(artifact_uri, cfg)  # the artifact, its variant's decode loop (`load`)
        # What this replica did, for metadata (and the disconnect test): generations running now,
        # finished by reason, and tokens generated in all.
        self.stats: dict[str, int] = {
            "active": 0,
            "tokens": 0,
            "completed": 0,
            "cancelled": 0,
        }
        self._metrics = _GenerationMetrics(self.artifact.name)
        self._metrics.buffer.sample(self._levels)
        self.kv_budget = KVBudget(
            cfg.generation.max_kv_cache_mib, self.generator.decoder, cfg.request_timeout_s / 2
        )
        self.chat = chat_template(self.artifact.preprocessor.state)

    def describe(self) -> str:
        return f"language model {self.artifact.name}"

    def load(self, variant: str) -> None:
        """The generator of `variant` and a decode loop on it; a loop already running is
        closed (its streams finish on the old session)."""
        self.generator = self._generator(variant)
        running: DecodeLoop | None = getattr(self, "loop", None)
        if running is not None:
            running.close()
        self.loop = self._loop()

    def _generator(self, variant: str) -> Generator:
        try:
            return Generator.from_artifact(
                self.artifact,
                variant,
                self.threads,
                max_prompt_tokens=self.cfg.generation.max_prompt_tokens,
            )
        except ValueError as e:  # a graph this version cannot run: one line naming the artifact
            raise ValueError(f"{self.artifact.uri}: {e}") from None

    def _loop(self) -> DecodeLoop:
        interval_s = self.cfg.generation.stream_interval_ms / 1000
        return DecodeLoop(self.generator, model=self.artifact.name, stream_interval_s=interval_s)

    async def check_health(self) -> None:
        """One greedy token through the decode loop: a loop thread that died or hangs fails
        the check (Serve's health_check_timeout_s), and Serve replaces the replica."""
        if not self.loop.alive():
            raise RuntimeError("the decode loop's thread has ended")
        probe = self.loop.submit(self.generator.encode("\n"), HEALTH_PROBE)
        try:
            async for _ in probe:
                pass
        finally:
            probe.close()

    def details(self) -> dict[str, Any]:
        kv = {
            "kv_cache_tokens": self.loop.cache_tokens(),
            "kv_reserved_tokens": self.kv_budget.padded_tokens(),
        }
        return {"generates": True, "generation": self.stats | self.loop.stats | kv}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """A generation's events; the request was validated by app.tasks.lm.http.serving."""
        if self.stats["active"] >= self.cfg.generation.max_streams:
            raise RequestError(
                503,
                f"model {self.artifact.name!r} is running serve.generation.max_streams="
                f"{self.cfg.generation.max_streams} generations; retry later",
                retry_after_s=1,
            )
        prompt = self.chat.render(request.messages) if request.messages else request.prompt
        special = not (request.messages and self.chat.writes_specials)
        try:
            ids = self.generator.encode(prompt, request.field, special)
        except PromptError as e:
            raise RequestError(400, str(e)) from None
        params = SamplingParams(**request.params)
        need = len(ids) + min(params.max_tokens, self.generator.block_size - len(ids))
        await self.kv_budget.reserve(need, self.artifact.name)
        generation = self.loop.submit(ids, params)
        timing = _Timing()
        self.stats["active"] += 1
        ended = "error"  # how the stream ended, for the counter: stop, length, cancelled, error
        try:
            yield Started(prompt_tokens=len(ids), version=self.artifact.version)
            async for piece in generation:
                timing.token_came()
                yield piece
            finished = self._end(generation)
            ended = finished.finish_reason
            yield finished
            self.stats["completed"] += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.stats["cancelled"] += 1
            ended = "cancelled"
            raise
        finally:
            generation.close()
            self.kv_budget.release(need)
            self.stats["active"] -= 1
            self.stats["tokens"] += generation.completion_tokens
            self._metrics.observe(timing, generation.completion_tokens, ended)

    def _levels(self) -> None:
        """The gauges, read by the metrics flush thread: streams running, those whose prompt is
        not yet in the decode loop's cache, and the tokens the batch's cache holds."""
        waiting = self.loop.waiting_count()
        self._metrics.levels(self.stats["active"] - waiting, waiting, self.loop.cache_tokens())

    def _end(self, generation: LoopGeneration) -> Finished:
        reason = generation.finish_reason
        if reason in FINISH_REASONS:  # the loop ends any other with an error
            return Finished(
                finish_reason=cast(FinishReason, reason),
                prompt_tokens=generation.prompt_tokens,
                completion_tokens=generation.completion_tokens,
                version=self.artifact.version,
            )
        raise RequestError(500, f"model {self.artifact.name!r} ended a generation early")


class KVBudget:
    """The KV-cache memory the decode batch may come to hold, within
    serve.generation.max_kv_cache_mib. The batch left-pads every row to its widest and a step
    writes its outputs (`present`) beside its inputs, so streams that may each reach `n_i`
    tokens (prompt plus max_tokens) cost rows x max(n_i) x 2 x the bytes of a token. A stream
    that does not fit waits for room up to `wait_s`, then is a 503 with Retry-After; one that
    could never fit is a 400."""

    STEP_COPIES = 2  # the cache and a step's present outputs

    def __init__(self, limit_mib: float | None, decoder: Any, wait_s: float = 0.0):
        self.limit = None if limit_mib is None else limit_mib * 2**20
        # A float32 key and value per layer, head and position.
        self.bytes_per_token = 2 * decoder.layers * decoder.heads * decoder.head_dim * 4
        self.wait_s = wait_s
        self.needs: list[int] = []  # tokens each admitted stream may reach

    def padded_tokens(self, needs: list[int] | None = None) -> int:
        """Token slots the batch of `needs` (default: the admitted streams) may come to hold."""
        needs = self.needs if needs is None else needs
        return len(needs) * max(needs, default=0)

    def cost(self, needs: list[int]) -> float:
        return self.padded_tokens(needs) * self.bytes_per_token * self.STEP_COPIES

    async def reserve(self, tokens: int, model: str) -> None:
        if self.limit is None:
            self.needs.append(tokens)
            return
        mib = f"serve.generation.max_kv_cache_mib={self.limit / 2**20:g}"
        if self.cost([tokens]) > self.limit:
            raise RequestError(
                400,
                f"prompt + max_tokens need {self.cost([tokens]) / 2**20:.1f} MiB of KV cache "
                f"(with a step's outputs), over {mib}",
            )
        deadline = time.monotonic() + self.wait_s
        while self.cost([*self.needs, tokens]) > self.limit:
            if time.monotonic() >= deadline:
                raise RequestError(
                    503,
                    f"model {model!r} has its KV cache ({mib}) in use; retry later",
                    retry_after_s=1,
                )
            await asyncio.sleep(0.02)  # streams end on this event loop: room shows up here
        self.needs.append(tokens)

    def release(self, tokens: int) -> None:
        self.needs.remove(tokens)


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

    def __init__(self, model: str, buffer: MetricBuffer | None = None):
        self.tags = {"model": model}
        self.buffer = buffer or process_buffer()
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
        self.ended = model_counter(
            "raytorch_generation_ended_total",
            "generations ended, by reason: stop, length, cancelled (the client left), error",
            tag_keys=("model", "reason"),
        )
        self.running = model_gauge("raytorch_generation_running", "generations decoding")
        self.waiting = model_gauge(
            "raytorch_generation_waiting", "generations admitted, their prompt not yet in cache"
        )
        self.kv_tokens = model_gauge(
            "raytorch_generation_kv_cache_tokens",
            "tokens held in the running generations' KV caches",
        )

    def observe(self, timing: _Timing, tokens: int, ended: str) -> None:
        self.buffer.inc(self.ended, self.tags | {"reason": ended})
        if tokens:
            self.buffer.inc(self.tokens, self.tags, by=tokens)
        if timing.first is None:  # refused, cancelled or ended before any text
            return
        self.buffer.observe(self.ttft, 1000 * (timing.first - timing.start), self.tags)
        if tokens > 1 and timing.last is not None:
            tpot = 1000 * (timing.last - timing.first) / (tokens - 1)
            self.buffer.observe(self.tpot, tpot, self.tags)

    def levels(self, running: int, waiting: int, kv_tokens: int) -> None:
        self.buffer.set(self.running, running, self.tags)
        self.buffer.set(self.waiting, waiting, self.tags)
        self.buffer.set(self.kv_tokens, kv_tokens, self.tags)


@serve.ingress()
class LMApp(SelfServing, LMServer):
    """A language model's replica: the same routes, generation instead of batched inference."""
