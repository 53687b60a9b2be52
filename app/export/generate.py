"""Text generation with an exported causal language model: ONNX Runtime, numpy and `tokenizers`
only (no torch, no Ray), so a Serve replica and the export gate run the same loop.

The exported graph (app/export/lm.py) takes `input_ids` [batch, tokens] after a KV cache
(`past_key_<i>` / `past_value_<i>` per block, [batch, heads, cached, head_dim], possibly 0
cached) and returns `logits` and the extended cache (`present_*`). A generation feeds the prompt
once, then one token per step: the prefix is never recomputed.

`Generator.generate` returns a `Generation`, a lazy iterator of text pieces: each `next()` runs at
most one model step, so a consumer that stops iterating (a client that disconnected) stops the
computation with it. Pieces are decoded incrementally so that a character split over several
byte-level tokens comes out whole, and text that could still turn into a `stop` string is held
back until it cannot.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

EOS = "<|endoftext|>"  # app/data/corpus.py's document separator: the model's end of text
REPLACEMENT = "\ufffd"  # what a byte-level decoder yields for an incomplete UTF-8 sequence


def past_name(kind: str, layer: int) -> str:
    return f"past_{kind}_{layer}"


def present_name(kind: str, layer: int) -> str:
    return f"present_{kind}_{layer}"


class PromptError(ValueError):
    """A prompt the model cannot take (too long, empty); the message names the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. `temperature` 0 is greedy (argmax); `top_k` 0 and `top_p` 1
    are off; `seed` makes sampling reproducible (None: fresh entropy per generation);
    `presence_penalty` and `frequency_penalty` lower the logit of each token already generated,
    once and once per time (OpenAI's definition), greedy decoding included. `logprobs` (None:
    off) reports each token's log-probability with that many most likely alternatives."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # each token's log-probability and this many alternatives

    def penalized(self, logits: np.ndarray, counts: dict[int, int]) -> np.ndarray:
        """`logits` less the penalties for the tokens generated so far (`counts`: id -> times)."""
        if not counts or (self.presence_penalty == 0 and self.frequency_penalty == 0):
            return logits
        ids = np.fromiter(counts, dtype=np.int64, count=len(counts))
        times = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
        out = logits.astype(np.float64)
        out[ids] -= self.presence_penalty + self.frequency_penalty * times
        return out


# --- the model step ------------------------------------------------------------------------------


POSITIONS, KEY_MASK = "position_ids", "attention_mask"


class KVDecoder:
    """One ONNX Runtime session of an exported LM graph and its cache layout. A graph with
    `position_ids` and `attention_mask` inputs (`batched`) can step streams of different
    lengths together (`KVBatch`); older artifacts' graphs step one stream at a time."""

    def __init__(self, session: Any):
        self.session = session
        inputs = {i.name: i for i in session.get_inputs()}
        self.layers = sum(1 for name in inputs if name.startswith("past_key_"))
        if "input_ids" not in inputs or self.layers == 0:
            raise ValueError("not a KV-cache language model graph (input_ids, past_key_0, ...)")
        self.batched = POSITIONS in inputs and KEY_MASK in inputs
        shape = inputs[past_name("key", 0)].shape  # [batch, heads, cached, head_dim]
        self.heads, self.head_dim = int(shape[1]), int(shape[3])
        self.vocab_size = int(session.get_outputs()[0].shape[-1])
        self.outputs = ["logits"] + [
            present_name(kind, i) for i in range(self.layers) for kind in ("key", "value")
        ]

    def empty_cache(self, batch: int = 1) -> list[np.ndarray]:
        empty = np.zeros((batch, self.heads, 0, self.head_dim), dtype=np.float32)
        return [empty] * (2 * self.layers)

    def step(
        self,
        ids: np.ndarray,
        cache: list[np.ndarray],
        positions: np.ndarray | None = None,
        mask: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list]:
        """Logits [batch, tokens, vocab] for `ids` [batch, tokens] after `cache`; the new cache.
        `positions` and `mask` (a batched graph's): by default every cache slot is the row's
        and the tokens follow it."""
        feed = {"input_ids": np.ascontiguousarray(ids, dtype=np.int64)}
        if self.batched:
            batch, tokens = feed["input_ids"].shape
            past = cache[0].shape[2]
            if positions is None:
                positions = np.broadcast_to(np.arange(past, past + tokens), (batch, tokens))
            if mask is None:
                mask = np.ones((batch, past + tokens), dtype=np.int64)
            feed[POSITIONS] = np.ascontiguousarray(positions, dtype=np.int64)
            feed[KEY_MASK] = np.ascontiguousarray(mask, dtype=np.int64)
        for i in range(self.layers):
            feed[past_name("key", i)] = cache[2 * i]
            feed[past_name("value", i)] = cache[2 * i + 1]
        logits, *presents = self.session.run(self.outputs, feed)
        return logits, presents


class KVBatch:
    """The caches of streams stepped together, one row each: a row's keys fill the last
    `lengths[row]` slots (left padding, masked out), so every row's next token goes in the same
    new slot. Rows join with the cache of their prompt and leave when their stream ends."""

    def __init__(self, decoder: KVDecoder):
        if not decoder.batched:
            raise ValueError("the graph has no position_ids/attention_mask: one stream a step")
        self.decoder = decoder
        self.cache = decoder.empty_cache(0)
        self.lengths: list[int] = []

    def __len__(self) -> int:
        return len(self.lengths)

    def join(self, cache: list[np.ndarray]) -> int:
        """Adds a stream whose cache (batch 1) holds its prompt; its row number."""
        self.join_many([cache])
        return len(self.lengths) - 1

    def join_many(self, caches: Sequence[list[np.ndarray]]) -> None:
        """Adds several streams at once (one copy of the batch, not one per stream)."""
        if not caches:
            return
        lengths = [c[0].shape[2] for c in caches]
        width = max(self.cache[0].shape[2], *lengths)
        grow = width - self.cache[0].shape[2]
        self.cache = [
            np.concatenate(
                [
                    _left_pad(mine, grow),
                    *(_left_pad(c[k], width - n) for c, n in zip(caches, lengths, strict=True)),
                ]
            )
            for k, mine in enumerate(self.cache)
        ]
        self.lengths += lengths

    def leave(self, *rows: int) -> None:
        """Drops rows (the rows after them move up); slots no row uses any more are freed."""
        gone = set(rows)
        self.lengths = [n for i, n in enumerate(self.lengths) if i not in gone]
        keep = max(self.lengths, default=0)
        self.cache = [np.delete(c, rows, axis=0)[:, :, c.shape[2] - keep :] for c in self.cache]

    def row_cache(self, row: int) -> list[np.ndarray]:
        """A row's own cache (batch 1, its length), as it joined and has grown since."""
        n = self.lengths[row]
        return [c[row : row + 1, :, c.shape[2] - n :] for c in self.cache]

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        """One new token per row -> each row's next-token logits [rows, vocab]."""
        width = self.cache[0].shape[2]
        lengths = np.asarray(self.lengths)
        mask = np.arange(width + 1)[None, :] >= (width - lengths)[:, None]
        ids = np.asarray(tokens, dtype=np.int64)[:, None]
        logits, self.cache = self.decoder.step(ids, self.cache, lengths[:, None], mask)
        self.lengths = [n + 1 for n in self.lengths]
        return logits[:, -1]


def _left_pad(cache: np.ndarray, slots: int) -> np.ndarray:
    if slots == 0:
        return cache
    return np.pad(cache, ((0, 0), (0, 0), (slots, 0), (0, 0)))


def prefill(
    decoder: KVDecoder, prompts: Sequence[Sequence[int]]
) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """Several prompts in one call of a batched graph: each one's last-position logits
    [prompts, vocab] and its own cache (batch 1, its length). The prompts are right-padded:
    a prompt's tokens come before its padding, so no real token ever attends to a pad (and the
    pads, masked, see real tokens: no row of the softmax is empty)."""
    lengths = [len(p) for p in prompts]
    rows, width = len(prompts), max(lengths)
    ids = np.zeros((rows, width), dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.int64)
    for i, prompt in enumerate(prompts):
        ids[i, : lengths[i]], mask[i, : lengths[i]] = prompt, 1
    positions = np.broadcast_to(np.arange(width), (rows, width))
    logits, cache = decoder.step(ids, decoder.empty_cache(rows), positions, mask)
    last = logits[np.arange(rows), np.asarray(lengths) - 1]
    return last, [[c[i : i + 1, :, :n] for c in cache] for i, n in enumerate(lengths)]


def greedy(decoder: KVDecoder, prompt: Sequence[int], tokens: int) -> list[int]:
    """`tokens` argmax continuations of `prompt` (the export gate compares fp32 and int8)."""
    logits, cache = decoder.step(np.asarray([prompt]), decoder.empty_cache())
    out: list[int] = []
    for _ in range(tokens):
        out.append(int(logits[0, -1].argmax()))
        logits, cache = decoder.step(np.asarray([[out[-1]]]), cache)
    return out


# --- sampling -----------------------------------------------------------------------------------


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a position's logits: greedy at temperature 0, else softmax sampling
    restricted to the `top_k` most likely tokens and to the smallest set whose probability
    reaches `top_p` (nucleus)."""
    if params.temperature == 0:
        return int(logits.argmax())
    z = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < len(z):
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        # Keep a token while the mass before it is below top_p: the most likely always stays.
        keep = np.cumsum(sorted_probs) - sorted_probs < params.top_p
        probs = np.zeros_like(probs)
        probs[order[keep]] = sorted_probs[keep]
        probs /= probs.sum()
    cumulative = np.cumsum(probs)
    return int(
        min(
            np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(probs) - 1
        )
    )


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token as OpenAI's `logprobs` report it: its text and UTF-8 bytes, its
    log-probability under the model (before temperature, top-k/top-p and penalties, as vLLM
    reports them) and the `top` most likely tokens at that position, most likely first."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()


class TokenTexts:
    """A token id's text and bytes. Byte-level BPE tokens map back to their bytes exactly (a
    token that ends inside a multi-byte character has bytes but no whole text of its own)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_of = {c: b for b, c in enumerate(byte_level_alphabet())}

    def __call__(self, token: int) -> tuple[str, tuple[int, ...]]:
        text = self.tokenizer.decode([token])
        piece = self.tokenizer.id_to_token(token) or ""
        if piece and all(c in self.byte_of for c in piece):
            return text, tuple(self.byte_of[c] for c in piece)
        return text, tuple(text.encode())

    def logprobs(self, logits: np.ndarray, token: int, top: int) -> TokenLogprob:
        z = logits.astype(np.float64)
        z -= z.max()
        logp = z - np.log(np.exp(z).sum())
        best = np.argpartition(-logp, top)[:top] if 0 < top < len(logp) else np.arange(len(logp))
        best = best[np.argsort(-logp[best], kind="stable")][:top]
        alternatives = tuple((*self(int(i)), float(logp[i])) for i in best)
        return TokenLogprob(*self(token), float(logp[token]), alternatives)


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-character table (byte b is character [b]): printable bytes stand for
    themselves, the rest are shifted past 255."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


# --- text out -----------------------------------------------------------------------------------


class IncrementalDecoder:
    """Token ids in, new text out, one token at a time. Decodes a short window (the tokens since
    the last complete piece) and emits only once the text no longer ends in a partial UTF-8
    character, so a multi-byte character split over tokens comes out whole."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """What is still held back (an incomplete character comes out as U+FFFD)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]


class StopFilter:
    """Holds back text that could still become one of the `stop` strings; cuts the text at the
    first stop string found. `done` turns true once one is found."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.pending = ""
        self.done = False

    def feed(self, text: str) -> str:
        self.pending += text
        if not self.stop:
            out, self.pending = self.pending, ""
            return out
        found = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if found:
            out, self.pending, self.done = self.pending[: min(found)], "", True
            return out
        hold = max((self._partial(s) for s in self.stop), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def _partial(self, stop: str) -> int:
        """The length of the longest end of `pending` that begins `stop`."""
        for n in range(min(len(stop) - 1, len(self.pending)), 0, -1):
            if self.pending.endswith(stop[:n]):
                return n
        return 0

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# --- a generation -------------------------------------------------------------------------------


@dataclass
class Generation:
    """A lazy stream of text pieces. After it ends: `finish_reason` ("stop": end of text or a
    stop string, "length": `max_tokens` or the context window) and the token counts. With
    `SamplingParams.logprobs`, `logprobs` holds the tokens that made the piece just returned."""

    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens behind the piece last returned
    _pieces: Iterator[str] = field(default_factory=lambda: iter(()), repr=False)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop generating (what a disconnected client's stream does); safe to call twice."""
        close = getattr(self._pieces, "close", None)
        try:
            if close is not None:
                close()
        except ValueError:  # a step is running on another thread: it is the last one
            pass
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def text(self) -> str:
        """Run to the end and return the whole completion."""
        return "".join(self)


class Generator:
    """An exported LM ready to complete prompts: session, tokenizer and the window it can read."""

    def __init__(
        self,
        session: Any,
        tokenizer: Any,
        block_size: int,
        max_prompt_tokens: int | None = None,
    ):
        self.decoder = KVDecoder(session)
        self.tokenizer = tokenizer
        self.block_size = block_size
        # A prompt must leave room for at least one generated token in the position table.
        limit = block_size - 1
        self.max_prompt_tokens = min(limit, max_prompt_tokens) if max_prompt_tokens else limit
        self.eos_id = tokenizer.token_to_id(EOS)
        self.token_texts = TokenTexts(tokenizer)
        # Byte-level BPE: a token covers at most this many bytes, so a prompt of more than
        # max_prompt_tokens times as many bytes is too long without tokenizing it.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_bytes = self.max_prompt_tokens * max(longest, 1)

    @classmethod
    def from_artifact(
        cls, artifact: Any, variant: str = "int8", threads: int = 1, **kwargs: Any
    ) -> Generator:
        pre = artifact.preprocessor
        return cls(artifact.session(variant, threads), pre.tokenizer, pre.block_size, **kwargs)

    def encode(self, prompt: str, field_name: str = "prompt") -> list[int]:
        if len(prompt) > self.max_prompt_bytes:  # chars <= bytes: a cheap bound, no tokenizing
            raise PromptError(
                field_name,
                f"{len(prompt)} characters, more than the {self.max_prompt_tokens}-token limit "
                "can hold",
            )
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if not ids:
            raise PromptError(field_name, "must not be empty")
        if len(ids) > self.max_prompt_tokens:
            raise PromptError(
                field_name, f"{len(ids)} tokens, more than the limit of {self.max_prompt_tokens}"
            )
        return ids

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        generation = Generation(prompt_tokens=len(prompt_ids))
        generation._pieces = self._pieces(list(prompt_ids), params, generation)
        return generation

    def _pieces(self, prompt: list[int], params: SamplingParams, out: Generation) -> Iterator[str]:
        decoding = Decoding(self, prompt, params)
        logits, cache = self.decoder.step(np.asarray([prompt]), self.decoder.empty_cache())
        while True:
            pieces = decoding.take(logits[0, -1])
            out.completion_tokens, out.finish_reason = decoding.tokens, decoding.finish_reason
            for piece in pieces:
                out.logprobs = decoding.pop_logprobs()
                yield piece
            if decoding.finish_reason is not None:
                return
            logits, cache = self.decoder.step(np.asarray([[decoding.token]]), cache)


class Decoding:
    """One generation's state between model steps: its sampler, penalties, text and stop
    strings. `take` turns a step's logits into text; once `finish_reason` is set the stream
    takes no more steps ("stop": end of text or a stop string, "length": `max_tokens` or the
    position table). The one-stream path and the replica's decode loop both drive it."""

    def __init__(self, generator: Generator, prompt: Sequence[int], params: SamplingParams):
        self.params, self.eos_id = params, generator.eos_id
        self.token_texts = generator.token_texts
        self.logprobs: list[TokenLogprob] = []  # of tokens whose text has not gone out yet
        self.rng = np.random.default_rng(params.seed)
        self.text, self.stops = IncrementalDecoder(generator.tokenizer), StopFilter(params.stop)
        self.counts = collections.Counter[int]()
        # Tokens the position table still has room for after the prompt.
        self.budget = min(params.max_tokens, generator.block_size - len(prompt))
        self.tokens = 0
        self.token: int | None = None  # the last one sampled: the next step's input
        self.finish_reason: str | None = None

    def take(self, logits: np.ndarray) -> list[str]:
        """The text that the token sampled from `logits` (one position's) adds."""
        if self.budget <= 0:
            return self._finish("length")
        token = sample(self.params.penalized(logits, self.counts), self.params, self.rng)
        if token == self.eos_id:
            return self._finish("stop")
        if self.params.logprobs is not None:
            self.logprobs.append(self.token_texts.logprobs(logits, token, self.params.logprobs))
        self.tokens, self.token = self.tokens + 1, token
        self.counts[token] += 1
        piece = self.stops.feed(self.text.add(token))
        pieces = [piece] if piece else []
        if self.stops.done:  # what followed the stop string is dropped
            self.finish_reason = "stop"
        elif self.tokens >= self.budget:  # no step for a token that will not be used
            pieces += self._finish("length")
        return pieces

    def pop_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The tokens behind the text about to go out (held-back text keeps its tokens)."""
        out, self.logprobs = tuple(self.logprobs), []
        return out

    def _finish(self, reason: str) -> list[str]:
        tail = self.stops.feed(self.text.flush())
        tail += "" if self.stops.done else self.stops.flush()
        self.finish_reason = "stop" if self.stops.done else reason
        return [tail] if tail else []
