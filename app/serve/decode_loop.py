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
from collections.abc import AsyncIterator, Sequence

import numpy as np

from app.export.generate import Decoding, Generator, KVBatch, SamplingParams, prefill
from app.serve.types import Piece

log = logging.getLogger("ray.serve")
_END = object()
# Short prompts filled together in one step: at most this many chunks' worth of tokens, so a
# burst of arrivals delays the running streams by a bounded step.
PREFILL_CHUNKS_TOGETHER = 8


class LoopGeneration:
    """A stream in the decode loop, as the replica reads it: `async for piece in ...`, then
    `finish_reason` and the token counts; `close()` takes it out of the batch."""

    def __init__(self, generator: Generator, prompt: Sequence[int], params: SamplingParams):
        self.prompt = list(prompt)
        self.decoding = Decoding(generator, prompt, params)
        self.prompt_tokens = len(self.prompt)
        self.cancelled = False
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
        items: list[object] = [
            Piece(text, self.decoding.pop_logprobs() if i == 0 else ())
            for i, text in enumerate(pieces)
        ]
        return [*items, *([_END] if ended else [])]

    def hand(self, pieces: list[str], ended: bool) -> None:
        """From the loop's thread: text for the consumer, and whether the stream ended."""
        deliver([(self, self.handoff(pieces, ended))])

    def put(self, items: list[object]) -> None:
        for item in items:
            self._events.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[Piece]:
        """The pieces as they come; pieces that came while the consumer was busy go out
        together (one event, not one per token), the first as soon as it exists."""
        while (item := await self._events.get()) is not _END:
            assert isinstance(item, Piece)
            text, logprobs, ended = item.text, item.logprobs, False
            while not self._events.empty():
                more = self._events.get_nowait()
                if more is _END:
                    ended = True
                    break
                assert isinstance(more, Piece)
                text, logprobs = text + more.text, logprobs + more.logprobs
            yield Piece(text, logprobs)
            if ended:
                return


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
        generation.put(items)


class DecodeLoop:
    """The replica's one decode thread. `stats["batch_peak"]`: the most streams stepped
    together so far."""

    def __init__(self, generator: Generator, prefill_chunk: int = 64):
        self.generator, self.prefill_chunk = generator, prefill_chunk
        self.batch = KVBatch(generator.decoder)
        self.rows: list[LoopGeneration] = []  # in batch row order
        self.waiting: queue.SimpleQueue[LoopGeneration] = queue.SimpleQueue()
        self.prefilling: list[_Prefill] = []  # in arrival order, the first one advancing
        self.stats = {"batch_peak": 0, "steps": 0}
        self._closing = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> LoopGeneration:
        """A new stream (call from the event loop that will read it)."""
        generation = LoopGeneration(self.generator, prompt, params)
        self.waiting.put(generation)
        self._wake.set()
        return generation

    def waiting_count(self) -> int:
        """Streams submitted whose prompt is not yet in the batch (read from any thread)."""
        return self.waiting.qsize() + len(self.prefilling)

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
                self._admit()
                self._drop_cancelled()
                if self.rows:
                    self._step()
            except Exception:  # noqa: BLE001 - a step that fails ends its streams, not the loop
                log.exception("decode step failed; ending %d streams", len(self.rows))
                for generation in [*self.rows, *(p.generation for p in self.prefilling)]:
                    generation.hand([], ended=True)
                self.rows, self.prefilling = [], []
                self.batch = KVBatch(self.generator.decoder)

    def _admit(self) -> None:
        """Prompts into the batch: the short ones that came (up to a token budget) filled
        together in one call, and one chunk of the first long one; a prompt done joins the
        batch (unless its first token already ends it)."""
        while not self.waiting.empty():
            self.prefilling.append(_Prefill(self.waiting.get(), self.generator))
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
            long = self.prefilling[0]
            logits = long.advance(self.prefill_chunk)
            if logits is not None:
                self.prefilling.remove(long)
                self._join([(long.generation, logits, long.cache)])

    def _fill_together(self, group: list[_Prefill]) -> None:
        logits, caches = prefill(self.generator.decoder, [p.generation.prompt for p in group])
        for p in group:
            self.prefilling.remove(p)
        self._join([(p.generation, logits[i], caches[i]) for i, p in enumerate(group)])

    def _join(self, filled: list[tuple[LoopGeneration, np.ndarray, list[np.ndarray]]]) -> None:
        """Streams whose prompt is in their cache: each samples its first token, and those it
        does not end join the batch together."""
        going = [(g, cache) for g, logits, cache in filled if self._took(g, logits)]
        self.batch.join_many([cache for _, cache in going])
        self.rows += [g for g, _ in going]

    def _drop_cancelled(self) -> None:
        for row in reversed(range(len(self.rows))):
            if self.rows[row].cancelled:
                self.rows.pop(row).hand([], ended=True)
                self.batch.leave(row)

    def _step(self) -> None:
        tokens = [generation.decoding.token for generation in self.rows]
        logits = self.batch.step(tokens)  # type: ignore[arg-type]  # every row has sampled
        self.stats["steps"] += 1
        self.stats["batch_peak"] = max(self.stats["batch_peak"], len(self.rows))
        handoffs, ended = [], []
        for row, generation in enumerate(self.rows):
            pieces = generation.decoding.take(logits[row])
            if generation.decoding.finish_reason is not None:
                ended.append(row)
            handoffs.append((generation, generation.handoff(pieces, row in ended[-1:])))
        deliver(handoffs)
        if ended:
            self.batch.leave(*ended)
            self.rows = [g for row, g in enumerate(self.rows) if row not in set(ended)]

    @staticmethod
    def _took(generation: LoopGeneration, logits: np.ndarray) -> bool:
        """Samples the stream's next token and hands its text on; whether it goes on."""
        pieces = generation.decoding.take(logits)
        ended = generation.decoding.finish_reason is not None
        generation.hand(pieces, ended)
        return not ended


class _Prefill:
    """A prompt filling its cache a chunk at a time."""

    def __init__(self, generation: LoopGeneration, generator: Generator):
        self.generation, self.decoder = generation, generator.decoder
        self.cache = self.decoder.empty_cache()
        self.done = 0

    def advance(self, chunk: int) -> np.ndarray | None:
        """The next chunk into the cache; the last position's logits once the prompt is in."""
        prompt = self.generation.prompt
        ids = np.asarray([prompt[self.done : self.done + chunk]])
        logits, self.cache = self.decoder.step(ids, self.cache)
        self.done += ids.shape[1]
        return logits[0, -1] if self.done >= len(prompt) else None
