"""From a model step's logits to a stream's text, and the exported model it runs on.

- `Generator`: the session, tokenizer and window of an exported language model, and its prompt
  limits.
- The sampler: `SamplingParams` (temperature, top-k, top-p, seed, OpenAI's penalties) and
  `sample_rows`, a token for each row of a step, each row on its own generator; token
  log-probabilities as OpenAI reports them.
- The text: `IncrementalDecoder` (whole characters only) and `StopFilter` (stop strings held back
  until they cannot match).
- `Decoding`: one stream's state between steps, tying the three together; the decode loop
  (app/runtime/decode_loop.py) drives it, a stream alone its smallest case.

One module, because a generated token passes through all of it on every step. numpy only.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.runtime.kv import KVDecoder
from app.runtime.types import TokenLogprob

REPLACEMENT = "\ufffd"  # what a byte-level decoder yields for an incomplete UTF-8 sequence


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


DRAW_BLOCK = 64  # tokens per block of the sampler's two-level running sum


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


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a position's logits: `sample_rows` with one row."""
    return sample_rows(logits[None], [params], [rng])[0]


def sample_rows(
    logits: np.ndarray, params: Sequence[SamplingParams], rngs: Sequence[np.random.Generator]
) -> list[int]:
    """A token id for each row of `logits` [rows, vocab], row i by `params[i]` with its own
    generator `rngs[i]` (one draw each, so a row's token never depends on its batch mates):
    greedy at temperature 0, else softmax sampling restricted to the `top_k` most likely
    tokens and to the smallest set whose probability reaches `top_p` (nucleus). The rows
    sampling the plain softmax share one vectorised pass; greedy rows one argmax."""
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    vocab = logits.shape[1]
    plain = [
        i
        for i, p in enumerate(params)
        if p.temperature != 0 and not 0 < p.top_k < vocab and p.top_p >= 1.0
    ]
    if greedy:
        for i, token in zip(greedy, logits[greedy].argmax(axis=1).tolist(), strict=True):
            tokens[i] = token
    if plain:
        temperatures = np.asarray([params[i].temperature for i in plain], np.float32)[:, None]
        z = logits[plain].astype(np.float32) / temperatures  # float32: exp costs a third
        weights = np.exp(z - z.max(axis=1, keepdims=True))
        for i, token in zip(plain, _draw(weights, [rngs[i] for i in plain]), strict=True):
            tokens[i] = token
    for i in sorted(set(range(len(params))) - set(greedy) - set(plain)):
        weights = _restricted(logits[i].astype(np.float64) / params[i].temperature, params[i])
        tokens[i] = _draw(weights[None], [rngs[i]])[0]
    return tokens


def _draw(weights: np.ndarray, rngs: Sequence[np.random.Generator]) -> list[int]:
    """A token for each row of unnormalised probabilities `weights` [rows, vocab], by inverse
    transform: the first token whose cumulative weight passes a uniform draw of the row's
    total. The running sum is taken over blocks of DRAW_BLOCK tokens, then within the one
    block the draw falls in (a full-vocabulary running sum is a serial pass per row)."""
    rows, vocab = weights.shape
    if pad := -vocab % DRAW_BLOCK:
        weights = np.pad(weights, ((0, 0), (0, pad)))
    upto = np.cumsum(weights.reshape(rows, -1, DRAW_BLOCK).sum(axis=2, dtype=np.float64), axis=1)
    tokens = []
    for row, rng in enumerate(rngs):
        target = rng.random() * upto[row, -1]
        block = min(int(np.searchsorted(upto[row], target, side="right")), upto.shape[1] - 1)
        start = block * DRAW_BLOCK
        within = np.cumsum(weights[row, start : start + DRAW_BLOCK], dtype=np.float64)
        rest = target - (upto[row, block - 1] if block else 0.0)
        at = int(np.searchsorted(within, rest, side="right"))
        if at == DRAW_BLOCK:  # rounding put the draw past the block's end: its last token
            at = int(np.flatnonzero(within < within[-1]).max(initial=-1)) + 1
        tokens.append(start + at)
    return tokens


def _restricted(z: np.ndarray, params: SamplingParams) -> np.ndarray:
    """One row's softmax of scaled logits `z`, kept on its top-k tokens and its nucleus."""
    if 0 < params.top_k < len(z):
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    return nucleus(probs, params.top_p) if params.top_p < 1.0 else probs


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """`probs` kept on the smallest most-likely prefix whose mass reaches `top_p` (ties in
    token order, as a stable full sort), renormalised. The prefix is found among a growing
    candidate set (the tokens at least as likely as the k-th), so a peaked distribution sorts
    a few dozen tokens rather than the whole vocabulary on the decode thread."""
    k = min(64, len(probs))
    while True:
        order = descending_prefix(probs, k)
        sorted_probs = probs[order]
        before = np.cumsum(sorted_probs) - sorted_probs
        mass = before[-1] + sorted_probs[-1]
        if mass >= top_p or len(order) == len(probs):
            break
        # Grow by the mass still missing (twice over), and past a quarter of the vocabulary
        # sort it all: every round repartitions the whole vocabulary, and a flat
        # distribution's nucleus is most of it.
        k = math.ceil(2 * len(order) * top_p / max(mass, 1e-12))
        k = k if 4 * k < len(probs) else len(probs)
    # Keep a token while the mass before it is below top_p: the most likely always stays.
    keep = before < top_p
    out = np.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out / out.sum()


class TokenTexts:
    """A token id's text and bytes, for byte-level BPE (GPT-2, Llama 3, Qwen: a token's
    characters stand for its bytes) and byte-fallback tokenizers (Llama 2, Mistral: `<0x0A>`
    is the byte 0x0A, `▁` a space) alike: a token that ends inside a multi-byte character has
    bytes but no whole text of its own."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_of = {c: b for b, c in enumerate(byte_level_alphabet())}

    def __call__(self, token: int) -> tuple[str, tuple[int, ...]]:
        text = self.tokenizer.decode([token])
        piece = self.tokenizer.id_to_token(token) or ""
        if BYTE_TOKEN.fullmatch(piece):
            return text, (int(piece[3:5], 16),)
        if piece and all(c in self.byte_of for c in piece):
            return text, tuple(self.byte_of[c] for c in piece)
        if piece.startswith("▁"):  # sentencepiece's space, which decode drops at the start
            return text, tuple(piece.replace("▁", " ").encode())
        return text, tuple(text.encode())

    def logprobs(self, logits: np.ndarray, token: int, top: int) -> TokenLogprob:
        z = logits.astype(np.float64)
        z -= z.max()
        logp = z - np.log(np.exp(z).sum())
        best = top_tokens(logp, top)
        alternatives = tuple((*self(int(i)), float(logp[i])) for i in best)
        return TokenLogprob(*self(token), float(logp[token]), alternatives)


def top_tokens(scores: np.ndarray, top: int) -> np.ndarray:
    """The ids of the `top` highest scores, highest first (ties in token order)."""
    top = min(max(top, 0), len(scores))
    if top == 0:
        return np.zeros(0, dtype=np.int64)
    return descending_prefix(scores, top)[:top]


def descending_prefix(values: np.ndarray, k: int) -> np.ndarray:
    """The ids of every value at least as large as the k-th largest (k or more, ties kept),
    largest first, ties in id order: the start of a stable descending sort, found by partial
    selection, never a sort of the whole vocabulary."""
    if k >= len(values):
        return np.argsort(-values, kind="stable")
    kth = np.partition(values, len(values) - k)[len(values) - k]
    candidates = np.flatnonzero(values >= kth)
    return candidates[np.argsort(-values[candidates], kind="stable")]


BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback tokenizer's byte


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


class PromptError(ValueError):
    """A prompt the model cannot take (too long, empty); the message names the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class Generator:
    """An exported LM ready to complete prompts: session, tokenizer and the window it can read."""

    def __init__(
        self,
        session: Any,
        tokenizer: Any,
        block_size: int,
        end_ids: Sequence[int],
        max_prompt_tokens: int | None = None,
    ):
        self.decoder = KVDecoder(session)
        self.tokenizer = tokenizer
        self.block_size = block_size
        # A prompt must leave room for at least one generated token in the position table.
        limit = block_size - 1
        self.max_prompt_tokens = min(limit, max_prompt_tokens) if max_prompt_tokens else limit
        self.end_ids = frozenset(end_ids)  # any of them ends a generation
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
        session = artifact.session(variant, threads)
        return cls(session, pre.tokenizer, pre.block_size, pre.end_ids, **kwargs)

    def encode(self, prompt: str, field_name: str = "prompt", special: bool = True) -> list[int]:
        """A prompt's ids. `special`: the tokenizer's own special tokens around it (a BOS, as
        the model saw in training); a chat template renders its own, so chat prompts pass
        False."""
        if len(prompt) > self.max_prompt_bytes:  # chars <= bytes: a cheap bound, no tokenizing
            raise PromptError(
                field_name,
                f"{len(prompt)} characters, more than the {self.max_prompt_tokens}-token limit "
                "can hold",
            )
        ids = self.tokenizer.encode(prompt, add_special_tokens=special).ids
        if not ids:
            raise PromptError(field_name, "must not be empty")
        if len(ids) > self.max_prompt_tokens:
            raise PromptError(
                field_name, f"{len(ids)} tokens, more than the limit of {self.max_prompt_tokens}"
            )
        return ids


class Decoding:
    """One generation's state between model steps: its sampler, penalties, text and stop
    strings. `take` turns a step's logits into text; once `finish_reason` is set the stream
    takes no more steps ("stop": end of text or a stop string, "length": `max_tokens` or the
    position table). The decode loop drives it."""

    def __init__(self, generator: Generator, prompt: Sequence[int], params: SamplingParams):
        self.params, self.end_ids = params, generator.end_ids
        self.token_texts = generator.token_texts
        self.logprobs: list[TokenLogprob] = []  # of tokens whose text has not gone out yet
        self.rng = np.random.default_rng(params.seed)
        self.text = IncrementalDecoder(generator.tokenizer)
        # No stop strings (most streams): no filter to pass each token's text through.
        self.stops = StopFilter(params.stop) if any(params.stop) else None
        self.counts = collections.Counter[int]()
        self.penalized = bool(params.presence_penalty or params.frequency_penalty)
        # Tokens the position table still has room for after the prompt.
        self.budget = min(params.max_tokens, generator.block_size - len(prompt))
        self.tokens = 0
        self.token: int | None = None  # the last one sampled: the next step's input
        self.finish_reason: str | None = None

    def take(self, logits: np.ndarray) -> list[str]:
        """The text that the token sampled from `logits` (one position's) adds."""
        result = take_all([self], logits[None])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def scores(self, logits: np.ndarray) -> np.ndarray:
        """What this stream samples from: `logits` less its penalties."""
        return self.params.penalized(logits, self.counts) if self.penalized else logits

    def accept(self, token: int, logits: np.ndarray) -> list[str]:
        """The text that `token`, sampled from the model's `logits` (less this stream's
        penalties), adds; its logprobs are the model's, before the penalties."""
        if self.budget <= 0:
            return self._finish("length")
        if token in self.end_ids:
            return self._finish("stop")
        if self.params.logprobs is not None:
            self.logprobs.append(self.token_texts.logprobs(logits, token, self.params.logprobs))
        self.tokens, self.token = self.tokens + 1, token
        self.counts[token] += 1
        piece = self.text.add(token)
        piece = self.stops.feed(piece) if self.stops else piece
        pieces = [piece] if piece else []
        if self.stops and self.stops.done:  # what followed the stop string is dropped
            self.finish_reason = "stop"
        elif self.tokens >= self.budget:  # no step for a token that will not be used
            pieces += self._finish("length")
        return pieces

    def pop_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The tokens behind the text about to go out (held-back text keeps its tokens)."""
        out, self.logprobs = tuple(self.logprobs), []
        return out

    def _finish(self, reason: str) -> list[str]:
        tail = self.text.flush()
        if self.stops:
            tail = self.stops.feed(tail)
            tail += "" if self.stops.done else self.stops.flush()
        self.finish_reason = "stop" if self.stops and self.stops.done else reason
        return [tail] if tail else []


def take_all(decodings: Sequence[Decoding], logits: np.ndarray) -> list[list[str] | Exception]:
    """Each stream's text from its row of a step's `logits` [rows, vocab], the tokens sampled
    together; a stream whose own sampling fails gets its error, the others their text."""
    try:
        if any(d.penalized for d in decodings):
            rows = np.stack([d.scores(row) for d, row in zip(decodings, logits, strict=True)])
        else:
            rows = logits
        tokens = sample_rows(rows, [d.params for d in decodings], [d.rng for d in decodings])
    except Exception:  # noqa: BLE001 - find the stream it belongs to
        return [_take_alone(d, row) for d, row in zip(decodings, logits, strict=True)]
    out: list[list[str] | Exception] = []
    for decoding, token, row in zip(decodings, tokens, logits, strict=True):
        try:
            out.append(decoding.accept(token, row))
        except Exception as e:  # noqa: BLE001 - its own text or logprobs: only it ends
            out.append(e)
    return out


def _take_alone(decoding: Decoding, logits: np.ndarray) -> list[str] | Exception:
    try:
        token = sample(decoding.scores(logits), decoding.params, decoding.rng)
        return decoding.accept(token, logits)
    except Exception as e:  # noqa: BLE001 - its own sampling failed
        return e
