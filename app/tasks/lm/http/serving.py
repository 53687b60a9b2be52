"""The text-generation HTTP contract, without Ray or FastAPI: requests read into their strict
models (app/serve/http/protocol.py; a `RequestError` naming the field) and turned into generation
requests, and the response and Server-Sent-Event encodings.

- `POST /v1/completions`: OpenAI's completions API, the subset `model`, `prompt`, `max_tokens`,
  `temperature`, `top_k`, `top_p`, `stop`, `seed`, the penalties, `n`, `logprobs`, `echo`,
  `stream`, `stream_options.include_usage` and `user` (ignored); other OpenAI fields are refused
  by name rather than silently ignored.
- `POST /v1/chat/completions`: the same subset, `echo` aside, with `messages` (rendered by the
  replica, app/tasks/lm/chat.py), `max_completion_tokens`, `logprobs` and `top_logprobs`.
- `POST /v2/models/{name}/generate` and `/generate_stream`: Triton's generate extension,
  `{"text_input": ..., "parameters": {max_tokens, temperature, ...}}` -> `text_output`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from app.config import ServeConfig
from app.runtime.types import Finished, GenerationRequest, Piece, TokenLogprob
from app.serve.http.protocol import read
from app.tasks.lm.http.protocol import (
    ChatRequest,
    CompletionRequest,
    GenerateParameters,
    GenerateRequest,
    OpenAIRequest,
)

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Completion:
    model: str
    stream: bool
    request: GenerationRequest
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    n: int = 1  # completions of the prompt, each a generation (and a stream slot) of its own
    echo: bool = False  # the answer's text starts with the prompt

    def requests(self) -> list[GenerationRequest]:
        """One generation request per completion; with a seed, completion i samples with
        seed + i (reproducible, and not n copies of one answer)."""
        seed = self.request.params.get("seed")
        return [
            self.request
            if i == 0 or seed is None
            else replace(self.request, params={**self.request.params, "seed": seed + i})
            for i in range(self.n)
        ]


def parse_completion(body: bytes, cfg: ServeConfig) -> Completion:
    """The body of `POST /v1/completions`."""
    request: CompletionRequest = read(body, CompletionRequest, cfg)
    generation = GenerationRequest(request.prompt, _params(request, cfg, request.logprobs))
    return replace(_completion(request, generation), echo=bool(request.echo))


def parse_chat(body: bytes, cfg: ServeConfig) -> Completion:
    """The body of `POST /v1/chat/completions`: `messages`, rendered into one prompt by the
    replica with its model's chat template (app/tasks/lm/chat.py)."""
    request: ChatRequest = read(body, ChatRequest, cfg)
    messages = tuple({"role": m.role, "content": m.content} for m in request.messages)
    params = _params(request, cfg, request.logprob_count())
    return _completion(request, GenerationRequest("", params, "messages", messages))


def _params(request: OpenAIRequest, cfg: ServeConfig, logprobs: int | None) -> dict[str, Any]:
    return request.params(cfg) | ({} if logprobs is None else {"logprobs": logprobs})


def _completion(request: OpenAIRequest, generation: GenerationRequest) -> Completion:
    options = request.stream_options
    include_usage = bool(options is not None and options.include_usage)
    return Completion(
        request.model, bool(request.stream), generation, include_usage, request.n or 1
    )


def parse_generate(body: bytes, cfg: ServeConfig) -> GenerationRequest:
    """The body of Triton's `POST /v2/models/{name}/generate[_stream]`."""
    request: GenerateRequest = read(body, GenerateRequest, cfg)
    parameters = request.parameters or GenerateParameters()
    return GenerationRequest(request.text_input, parameters.params(cfg), field="text_input")


# --- responses ----------------------------------------------------------------------------------


def sse(event: dict[str, Any]) -> bytes:
    """One Server-Sent Event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


class CompletionEncoder:
    """OpenAI `text_completion` objects for one request: streamed chunks or the whole answer,
    a choice per completion (`index`), with the tokens' `logprobs` when they were asked for."""

    prefix, kind, whole_kind = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str, include_usage: bool = False, logprobs: bool = False):
        self.model, self.include_usage, self.logprobs = model, include_usage, logprobs
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # per choice: characters sent so far (text_offset)

    def _object(self, choices: list[dict[str, Any]], kind: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind or self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(
        self, index: int, piece: Piece, finish_reason: str | None, whole: bool
    ) -> dict[str, Any]:
        logprobs = self._logprobs(index, piece) if self.logprobs else None
        return {
            "text": piece.text,
            "index": index,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def _logprobs(self, index: int, piece: Piece) -> dict[str, Any]:
        """The completions API's form: parallel lists, alternatives as {token: logprob}."""
        # Counted in characters of the bytes before each token: the byte tokens of one split
        # character all start where that character does.
        offsets, at, before = [], self.offsets.get(index, 0), b""
        for token in piece.logprobs:
            offsets.append(at + len(before.decode("utf-8", errors="ignore")))
            before += bytes(token.bytes)
        self.offsets[index] = at + len(piece.text)
        return {
            "tokens": [t.token for t in piece.logprobs],
            "token_logprobs": [t.logprob for t in piece.logprobs],
            "top_logprobs": [_by_text(t) for t in piece.logprobs],
            "text_offset": offsets,
        }

    def start(self, index: int, text: str) -> dict[str, Any]:
        """The echoed prompt's chunk, before the completion's."""
        self.offsets[index] = len(text)
        return self._object(
            [{"text": text, "index": index, "logprobs": None, "finish_reason": None}]
        )

    def chunk(self, index: int, piece: Piece) -> dict[str, Any]:
        return self._object([self._choice(index, piece, None, whole=False)])

    def finish_chunk(self, index: int, end: Finished) -> dict[str, Any]:
        """The chunk with a choice's finish reason; without stream_options.include_usage it
        carries that completion's usage, as this API always has."""
        last = self._object([self._choice(index, Piece(""), end.finish_reason, whole=False)])
        return last if self.include_usage else {**last, "usage": end.usage()}

    def usage_chunk(self, ends: list[Finished]) -> dict[str, Any] | None:
        """With stream_options.include_usage, OpenAI's last chunk: no choices, the usage."""
        return {**self._object([]), "usage": total_usage(ends)} if self.include_usage else None

    def whole(self, answers: list[tuple[Piece, Finished]], echo: str = "") -> dict[str, Any]:
        choices = []
        for i, (piece, end) in enumerate(answers):
            self.offsets[i] = len(echo)
            whole = Piece(echo + piece.text, piece.logprobs)
            choices.append(self._choice(i, whole, end.finish_reason, whole=True))
        usage = total_usage([end for _, end in answers])
        return {**self._object(choices, self.whole_kind), "usage": usage}


class ChatEncoder(CompletionEncoder):
    """OpenAI `chat.completion` (whole) and `chat.completion.chunk` (streamed) objects."""

    prefix, kind, whole_kind = "chatcmpl", "chat.completion.chunk", "chat.completion"

    def _choice(
        self, index: int, piece: Piece, finish_reason: str | None, whole: bool
    ) -> dict[str, Any]:
        message = {"role": "assistant", "content": piece.text}
        key = "message" if whole else "delta"
        logprobs = None
        if self.logprobs:
            logprobs = {"content": [_chat_logprob(t) for t in piece.logprobs], "refusal": None}
        return {"index": index, key: message, "logprobs": logprobs, "finish_reason": finish_reason}


def _by_text(token: TokenLogprob) -> dict[str, float]:
    """Alternatives as {text: logprob}; two tokens of one text (bytes of a split character
    both read U+FFFD) keep the likelier."""
    out: dict[str, float] = {}
    for text, _, logprob in token.top:
        out.setdefault(text, logprob)
    return out


def _chat_logprob(token: TokenLogprob) -> dict[str, Any]:
    top = [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in token.top]
    return {
        "token": token.token,
        "logprob": token.logprob,
        "bytes": list(token.bytes),
        "top_logprobs": top,
    }


def total_usage(ends: list[Finished]) -> dict[str, int]:
    """One request's usage: its prompt once (as OpenAI counts it), every completion's tokens."""
    prompt, completion = ends[0].prompt_tokens, sum(end.completion_tokens for end in ends)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def triton_answer(model: str, version: str, text: str, end: Finished | None) -> dict[str, Any]:
    """One answer (or streamed event) of Triton's generate extension."""
    out: dict[str, Any] = {"model_name": model, "model_version": version, "text_output": text}
    if end is not None:
        out |= {
            "finish_reason": end.finish_reason,
            "prompt_tokens": end.prompt_tokens,
            "completion_tokens": end.completion_tokens,
        }
    return out
