"""Text generation: OpenAI's `POST /v1/completions` and `/v1/chat/completions`, and Triton's
generate extension
(`POST /v2/models/{name}/generate` and `/generate_stream`). A streamed answer is Server-Sent
Events; the first event is awaited before the 200, so a refusal is a plain error answer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from app.runtime.types import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    Piece,
    RequestError,
    Started,
)
from app.serve.http.clients import Models, close_events, unavailable_errors
from app.serve.http.gate import body
from app.serve.http.routes.common import config, models
from app.tasks.lm.http.serving import (
    DONE,
    ChatEncoder,
    Completion,
    CompletionEncoder,
    parse_chat,
    parse_completion,
    parse_generate,
    sse,
    triton_answer,
)

log = logging.getLogger("ray.serve")
router = APIRouter()
Events = AsyncIterator[GenerationEvent]


@router.post("/v1/completions")
async def completions(request: Request):
    completion = parse_completion(await body(request), config(request))
    return await openai_answer(request, completion, CompletionEncoder)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    completion = parse_chat(await body(request), config(request))
    return await openai_answer(request, completion, ChatEncoder)


async def openai_answer(
    request: Request, completion: Completion, encoding: type[CompletionEncoder]
):
    """One OpenAI completion request (`n` generations), whole or as Server-Sent Events ending
    in `[DONE]`."""
    name = completion.model
    streams = await start_all(models(request), name, completion.requests())
    logprobs = completion.request.params.get("logprobs") is not None
    encoder = encoding(name, completion.include_usage, logprobs)
    echo = completion.request.prompt if completion.echo else ""
    if not completion.stream:
        return encoder.whole(await collect_all(name, streams), echo)

    async def chunks():
        ends = []
        for index in range(len(streams) if echo else 0):
            yield sse(encoder.start(index, echo))
        async for index, event in merged(streams):
            if isinstance(event, Piece):
                yield sse(encoder.chunk(index, event))
            elif isinstance(event, Finished):
                ends.append(event)
                yield sse(encoder.finish_chunk(index, event))
        usage = encoder.usage_chunk(ends) if ends else None
        if usage is not None:
            yield sse(usage)
        yield DONE

    return event_stream(streams, chunks(), openai_stream_error)


async def start_all(m: Models, name: str, requests: list[GenerationRequest]) -> list[Events]:
    """Every generation started, each awaited to its first event (a refusal is a plain error
    answer); on a refusal the ones already started are stopped."""
    started: list[Events] = []
    try:
        for generation in requests:
            _, events = await m.generate(name, generation)
            started.append(events)
    except BaseException:
        for events in started:
            await close_events(events)
        raise
    return started


async def collect_all(name: str, streams: list[Events]) -> list[tuple[Piece, Finished]]:
    tasks = [asyncio.ensure_future(collect(name, events)) for events in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # one failed: the others stop too (each closes its own generation)
        for task in tasks:
            task.cancel()


async def merged(streams: list[Events]) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """The events of several generations as they come, each with its generation's index."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, GenerationEvent | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, events: Events) -> None:
        try:
            async for event in events:
                await queue.put((index, event))
            await queue.put((index, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(i, events)) for i, events in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        # Each generation is closed by its caller next: none may still be inside its pump.
        await asyncio.gather(*tasks, return_exceptions=True)


@router.post("/v2/models/{name}/generate")
@router.post("/v2/models/{name}/generate_stream")
async def generate(name: str, request: Request):
    m = models(request)
    m.get(name)
    generation = parse_generate(await body(request), config(request))
    first, events = await m.generate(name, generation)
    version = first.version if isinstance(first, Started) else ""
    if not request.url.path.endswith("/generate_stream"):
        whole, end = await collect(name, events)
        return triton_answer(name, version, whole.text, end)

    async def chunks():
        async for event in events:
            if isinstance(event, Piece):
                yield sse(triton_answer(name, version, event.text, None))
            elif isinstance(event, Finished):
                yield sse(triton_answer(name, version, "", event))

    return event_stream([events], chunks(), triton_stream_error)


async def collect(name: str, events: Events) -> tuple[Piece, Finished]:
    """A whole generation's text (and token logprobs) and its end. A replica that dies mid-way
    is a 503 (retry)."""
    pieces: list[Piece] = []
    end: Finished | None = None
    try:
        async for event in events:
            if isinstance(event, Piece):
                pieces.append(event)
            elif isinstance(event, Finished):
                end = event
    except unavailable_errors() as e:
        raise RequestError(
            503, f"model {name!r} became unavailable mid-generation ({type(e).__name__}); retry"
        ) from None
    finally:
        await close_events(events)
    if end is None:
        raise RequestError(503, f"model {name!r} ended the generation early; retry")
    text = "".join(p.text for p in pieces)
    return Piece(text, tuple(t for p in pieces for t in p.logprobs)), end


def stream_failure(error: Exception) -> RequestError:
    """What a stream that failed after its 200 tells its client."""
    if isinstance(error, RequestError):
        return error
    if isinstance(error, unavailable_errors()):
        return RequestError(503, f"the model became unavailable ({type(error).__name__}); retry")
    log.error("generation stream failed", exc_info=error)
    return RequestError(500, f"generation failed ({type(error).__name__})")


def openai_stream_error(error: Exception) -> bytes:
    """OpenAI's error object as an event, then the end of the stream (its clients raise it)."""
    failure = stream_failure(error)
    kind = "server_error" if failure.status >= 500 else "invalid_request_error"
    body = {"message": failure.message, "type": kind, "param": None, "code": failure.status}
    return sse({"error": body}) + DONE


def triton_stream_error(error: Exception) -> bytes:
    return sse({"error": stream_failure(error).message})


def event_stream(
    streams: list[Events],
    chunks: AsyncIterator[bytes],
    on_error: Callable[[Exception], bytes],
) -> StreamingResponse:
    async def guarded():
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:  # noqa: BLE001 - after the 200: say so in the stream itself
            yield on_error(e)
        finally:  # the client left (cancelled) or the stream ended: stop the model
            for events in streams:
                await close_events(events)

    headers: dict[str, Any] = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamingResponse(guarded(), media_type="text/event-stream", headers=headers)
