"""A generation's state between model steps (`Decoding`) and the exported model it runs on
(`Generator`: session, tokenizer, the window it reads, prompt limits). The decode loop
(app/runtime/decode_loop.py) drives both; a stream alone is its smallest case.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from app.runtime.kv import KVDecoder
from app.runtime.sampling import SamplingParams, TokenLogprob, TokenTexts, sample, sample_rows
from app.runtime.text import EOS, IncrementalDecoder, StopFilter


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


class Decoding:
    """One generation's state between model steps: its sampler, penalties, text and stop
    strings. `take` turns a step's logits into text; once `finish_reason` is set the stream
    takes no more steps ("stop": end of text or a stop string, "length": `max_tokens` or the
    position table). The decode loop drives it."""

    def __init__(self, generator: Generator, prompt: Sequence[int], params: SamplingParams):
        self.params, self.eos_id = params, generator.eos_id
        self.token_texts = generator.token_texts
        self.logprobs: list[TokenLogprob] = []  # of tokens whose text has not gone out yet
        self.rng = np.random.default_rng(params.seed)
        self.text, self.stops = IncrementalDecoder(generator.tokenizer), StopFilter(params.stop)
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
