"""Continuous batching: one decode loop per language-model replica.

A stream joins as soon as it comes. Prompts of at most `prefill_chunk` tokens that are waiting
fill their caches together in one right-padded call (up to PREFILL_CHUNKS_TOGETHER chunks'
worth of tokens a step); a longer prompt fills its cache a chunk at a time, one chunk between
two steps of the running streams (it delays them by a chunk's time, not its own). Every running
stream then advances one token per step of one shared ONNX Runtime call (`KVBatch`: left-padded
caches, masked). A stream leaves the batch the step it ends (end of text, a stop string, its
length, or its client gone) and the others go on; nothing waits for the slowest. The loop is
one thread, the only one stepping the batch; streams hand their text to the event loop that
asked for them, one wake-up of that loop a step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np

from app import hooks
from app.runtime.decoding import Decoding, Generator, SamplingParams, take_all
from app.runtime.kv import KVBatch, KVDecoder, prefill
from app.runtime.types import Piece, RequestError

log = logging.getLogger("ray.serve")
_END = object()
# Short prompts filled together in one step: at most this many chunks' worth of tokens, so a
# burst of arrivals delays the running streams by a bounded step.
PREFILL_CHUNKS_TOGETHER = 8


class LoopGeneration:
    """A stream in the decode loop, as the replica reads it: `async for piece in ...`, then
    `finish_reason` and the token counts; `close()` takes it out of the batch. A stream the
    loop could not continue raises its `RequestError` at the end of the pieces it got."""

    def __init__(
        self,
        generator: Generator,
        prompt: Sequence[int],
        params: SamplingParams,
        interval_s: float = 0.0,
    ):
        self.prompt = list(prompt)
        self.interval_s = interval_s
        self.decoding = Decoding(generator, prompt, params)
        self.prompt_tokens = len(self.prompt)
        self.cancelled = False
        self.error: RequestError | None = None
        self._events: asyncio.Queue[object] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    @property
    def completion_tokens(self) -> int:
        return self.decoding.tokens

    @property
    def finish_reason(self) -> str | None:
        if self.cancelled and self.decoding.finish_reason is None:
            return "cancelled"
        return self.decoding.finish_reason

    def close(self) -> None:
        self.cancelled = True

    def handoff(self, pieces: list[str], ended: bool) -> list[object]:
        """What the consumer gets for a step: its pieces (the first carrying the tokens'
        logprobs) and, if the stream ended, the end."""
        # Held-back text (no pieces) keeps its tokens' logprobs for the piece that carries it.
        logprobs = self.decoding.pop_logprobs() if pieces and self.decoding.logprobs else ()
        items: list[object] = [
            Piece(text, logprobs if i == 0 else ()) for i, text in enumerate(pieces)
        ]
        return [*items, *([_END] if ended else [])]

    def hand(self, pieces: list[str], ended: bool) -> None:
        """From the loop's thread: text for the consumer, and whether the stream ended."""
        deliver([(self, self.handoff(pieces, ended))])

    def fail(self, error: RequestError) -> None:
        """From the loop's thread: the stream ends with `error` (set before its end is handed
        over, so the consumer sees it when it reaches the end)."""
        self.error = error
        deliver([(self, [_END])])

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[Piece]:
        """The pieces as they come; pieces that came while the consumer was busy, or within
        `interval_s` of the last event, go out together (one event, not one per token), the
        first as soon as it exists."""
        ended, due = False, 0.0
        while not ended and (item := await self._events.get()) is not _END:
            assert isinstance(item, Piece)
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)  # what comes meanwhile joins this event
            text, logprobs = item.text, item.logprobs
            while not self._events.empty():
                more = self._events.get_nowait()
                if more is _END:
                    ended = True
                    break
                assert isinstance(more, Piece)
                text, logprobs = text + more.text, logprobs + more.logprobs
            due = time.monotonic() + self.interval_s
            yield Piece(text, logprobs)
        if self.error is not None:
            raise self.error


def deliver(handoffs: list[tuple[LoopGeneration, list[object]]]) -> None:
    """Hands each stream its items, one wake-up per event loop for all the streams it reads
    (not one per stream and token: each is a write to the loop's self-pipe)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[LoopGeneration, list[object]]]] = {}
    for generation, items in handoffs:
        if items:
            by_loop.setdefault(generation._loop, []).append((generation, items))
    for loop, batch in by_loop.items():
        loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[LoopGeneration, list[object]]]) -> None:
    for generation, items in batch:
        for item in items:
            generation._events.put_nowait(item)


class DecodeLoop:
    """The replica's one decode thread. `stats["batch_peak"]`: the most streams stepped
    together so far.

    A model call that fails for several streams is made again for each stream alone, once:
    the stream whose own call fails ends with its error (`stream_error`), the others go on with
    their alone results. So one bad stream never ends its batch mates, and no stream is left
    waiting or holding its slot."""

    def __init__(
        self,
        generator: Generator,
        prefill_chunk: int = 64,
        model: str = "model",
        stream_interval_s: float = 0.0,
    ):
        self.generator, self.prefill_chunk, self.model = generator, prefill_chunk, model
        self.stream_interval_s = stream_interval_s
        self.decoder = generator.decoder
        self.batch = KVBatch(self.decoder)
        self.rows: list[LoopGeneration] = []  # in batch row order
        self.waiting: queue.SimpleQueue[LoopGeneration] = queue.SimpleQueue()
        self.prefilling: list[_Prefill] = []  # in arrival order, the first one advancing
        self.stats = {"batch_peak": 0, "steps": 0, "failed": 0}
        self._closing = False
        self._wake = threading.Event()
        hooks.load_from_env()  # before the first step reads `hooks.armed`
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> LoopGeneration:
        """A new stream (call from the event loop that will read it)."""
        generation = LoopGeneration(self.generator, prompt, params, self.stream_interval_s)
        self.waiting.put(generation)
        self._wake.set()
        return generation

    def alive(self) -> bool:
        return self._thread.is_alive()

    def waiting_count(self) -> int:
        """Streams submitted whose prompt is not yet in the batch (read from any thread)."""
        return self.waiting.qsize() + len(self.prefilling)

    def cache_tokens(self) -> int:
        """Token slots the batch's KV cache holds now, padding included (from any thread)."""
        return self.batch.slots()

    def close(self) -> None:
        """The thread ends once the streams it has end (a variant switch starts a new loop)."""
        self._closing = True
        self._wake.set()

    def _run(self) -> None:
        while True:
            if not self.rows and not self.prefilling and self.waiting.empty():
                if self._closing:
                    return
                self._wake.wait()
                self._wake.clear()
            try:
                if self.prefilling or not self.waiting.empty():
                    self._admit()
                if any(generation.cancelled for generation in self.rows):
                    self._drop_cancelled()
                if self.rows:
                    self._step()
            except Exception as e:  # noqa: BLE001 - a fault outside any one stream's call
                self._fail_everything(e)

    # --- prompts into the batch -----------------------------------------------------------------

    def _admit(self) -> None:
        """Prompts into the batch: the short ones that came (up to a token budget) filled
        together in one call, and one chunk of the first long one; a prompt done joins the
        batch (unless its first token already ends it)."""
        while not self.waiting.empty():
            self.prefilling.append(_Prefill(self.waiting.get(), self.decoder))
        for gone in [p for p in self.prefilling if p.generation.cancelled]:
            self.prefilling.remove(gone)
            gone.generation.hand([], ended=True)
        short, budget = [], self.prefill_chunk * PREFILL_CHUNKS_TOGETHER
        for waiting in self.prefilling:
            n = len(waiting.generation.prompt)
            if waiting.done == 0 and n <= self.prefill_chunk and n <= budget:
                short.append(waiting)
                budget -= n
        if short:
            self._fill_together(short)
        if self.prefilling:  # the first of the rest advances a chunk
            self._advance(self.prefilling[0])

    def _fill_together(self, group: list[_Prefill]) -> None:
        for p in group:
            self.prefilling.remove(p)
        streams = [p.generation for p in group]
        try:
            hooks.fire("decode.call", streams=streams)
            logits, caches = prefill(self.decoder, [g.prompt for g in streams])
            filled = [(g, logits[i], caches[i]) for i, g in enumerate(streams)]
        except Exception as e:  # noqa: BLE001 - find the prompt it belongs to
            filled = self._each_alone(streams, e, self._fill_alone)
        self._join(filled)

    def _fill_alone(self, generation: LoopGeneration) -> tuple[np.ndarray, list[np.ndarray]]:
        logits, caches = prefill(self.decoder, [generation.prompt])
        return logits[0], caches[0]

    def _advance(self, long: _Prefill) -> None:
        try:
            hooks.fire("decode.call", streams=[long.generation])
            logits = long.advance(self.prefill_chunk)
        except Exception as e:  # noqa: BLE001 - its call alone: the failure is its own
            self.prefilling.remove(long)
            self._fail(long.generation, e)
            return
        if logits is not None:
            self.prefilling.remove(long)
            self._join([(long.generation, logits, long.cache)])

    def _join(self, filled: list[tuple[LoopGeneration, np.ndarray, list[np.ndarray]]]) -> None:
        """Streams whose prompt is in their cache: each samples its first token, and those it
        does not end join the batch together (the batch is unchanged if the join fails)."""
        going = [(g, cache) for g, logits, cache in filled if self._took(g, logits)]
        try:
            self._join_many(going)
        except Exception as e:  # noqa: BLE001 - e.g. no memory for the wider batch: each alone
            if len(going) == 1:
                self._fail(going[0][0], e)
                return
            for one in going:
                try:
                    self._join_many([one])
                except Exception as e:  # noqa: BLE001 - its own join: the failure is its own
                    self._fail(one[0], e)

    def _join_many(self, going: list[tuple[LoopGeneration, list[np.ndarray]]]) -> None:
        if going:
            hooks.fire("decode.join", streams=[g for g, _ in going])
            self.batch.join_many([cache for _, cache in going])
            self.rows += [g for g, _ in going]

    def _took(self, generation: LoopGeneration, logits: np.ndarray) -> bool:
        """Samples the stream's next token and hands its text on; whether it goes on."""
        try:
            pieces = generation.decoding.take(logits)
        except Exception as e:  # noqa: BLE001 - its own sampling: only it ends
            self._fail(generation, e)
            return False
        ended = generation.decoding.finish_reason is not None
        generation.hand(pieces, ended)
        return not ended

    # --- the shared step ------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        for row in reversed(range(len(self.rows))):
            if self.rows[row].cancelled:
                self.rows.pop(row).hand([], ended=True)
                self.batch.leave(row)

    def _step(self) -> None:
        tokens = [generation.decoding.token for generation in self.rows]
        try:
            if hooks.armed:  # every step: no call at all unless a test installed a hook
                hooks.fire("decode.call", streams=self.rows)
            logits = self.batch.step(tokens)  # type: ignore[arg-type]  # every row has sampled
        except Exception as e:  # noqa: BLE001 - find the stream it belongs to
            logits = self._step_alone(tokens, e)
        streams = self.rows
        self.stats["steps"] += 1
        self.stats["batch_peak"] = max(self.stats["batch_peak"], len(streams))
        handoffs, gone = [], []
        for row, (generation, taken) in enumerate(
            zip(streams, take_all([g.decoding for g in streams], logits), strict=True)
        ):
            if isinstance(taken, Exception):  # its own sampling: only it ends
                self._fail(generation, taken)
                gone.append(row)
                continue
            ended = generation.decoding.finish_reason is not None
            handoffs.append((generation, generation.handoff(taken, ended)))
            if ended:
                gone.append(row)
        deliver(handoffs)
        if gone:
            self.batch.leave(*gone)
            left = set(gone)
            self.rows = [g for row, g in enumerate(self.rows) if row not in left]

    def _step_alone(self, tokens: list[int | None], error: Exception) -> np.ndarray:
        """The failed step again, each row on its own cache; the batch is rebuilt from the
        rows that stepped, and their logits returned."""
        rows = self.rows
        log.warning("decode step of %d streams failed (%r); stepping each alone", len(rows), error)
        stepped, caches = [], []
        for row, generation in enumerate(rows):
            cache = self.batch.row_cache(row)
            try:
                hooks.fire("decode.call", streams=[generation])
                logits, cache = self.decoder.step(np.asarray([[tokens[row]]]), cache)
            except Exception as e:  # noqa: BLE001 - its own call: the failure is its own
                self._fail(generation, e)
                continue
            stepped.append((generation, logits[0, -1]))
            caches.append(cache)
        self.rows, self.batch = [g for g, _ in stepped], KVBatch(self.decoder)
        self.batch.join_many(caches)
        return np.stack([logits for _, logits in stepped]) if stepped else np.zeros((0, 1))

    def _each_alone(
        self,
        streams: list[LoopGeneration],
        error: Exception,
        alone: Callable[[LoopGeneration], tuple[np.ndarray, list[np.ndarray]]],
    ) -> list[tuple[LoopGeneration, np.ndarray, list[np.ndarray]]]:
        if len(streams) == 1:
            self._fail(streams[0], error)
            return []
        log.warning("a call for %d streams failed (%r); each alone", len(streams), error)
        out = []
        for generation in streams:
            try:
                hooks.fire("decode.call", streams=[generation])
                out.append((generation, *alone(generation)))
            except Exception as e:  # noqa: BLE001 - its own call: the failure is its own
                self._fail(generation, e)
        return out

    # --- failures -------------------------------------------------------------------------------

    def _fail(self, generation: LoopGeneration, error: BaseException) -> None:
        self.stats["failed"] += 1
        log.error("stream of %d prompt tokens failed", generation.prompt_tokens, exc_info=error)
        generation.fail(stream_error(error, self.model))

    def _fail_everything(self, error: BaseException) -> None:
        """A fault no one stream's call explains: every stream ends with it, and the loop
        starts again with an empty batch."""
        streams = [*self.rows, *(p.generation for p in self.prefilling)]
        while not self.waiting.empty():
            streams.append(self.waiting.get())
        log.error("decode loop fault; ending %d streams", len(streams), exc_info=error)
        for generation in streams:
            self.stats["failed"] += 1
            generation.fail(stream_error(error, self.model))
        self.rows, self.prefilling, self.batch = [], [], KVBatch(self.decoder)


def stream_error(error: BaseException, model: str) -> RequestError:
    """What a stream's client is told when its model call failed: lack of memory is a 503 to
    retry; anything else a 500 whose details stay in the replica's log."""
    if isinstance(error, MemoryError) or "allocat" in str(error).lower():
        return RequestError(
            503, f"model {model!r} ran out of memory for this generation; retry later", 1
        )
    return RequestError(
        500, f"model {model!r} failed generating ({type(error).__name__}; see the replica log)"
    )


class _Prefill:
    """A prompt filling its cache a chunk at a time."""

    def __init__(self, generation: LoopGeneration, decoder: KVDecoder):
        self.generation, self.decoder = generation, decoder
        self.cache = self.decoder.empty_cache()
        self.done = 0

    def advance(self, chunk: int) -> np.ndarray | None:
        """The next chunk into the cache; the last position's logits once the prompt is in."""
        prompt = self.generation.prompt
        ids = np.asarray([prompt[self.done : self.done + chunk]])
        last = np.asarray([[ids.shape[1] - 1]])  # a chunk's last position alone
        logits, self.cache = self.decoder.step(ids, self.cache, picked=last)
        self.done += ids.shape[1]
        return logits[0, -1] if self.done >= len(prompt) else None
