"""The text-generation HTTP contract, without Ray or FastAPI: request parsing and validation
(a `RequestError` naming the field), and the response and Server-Sent-Event encodings.

- `POST /v1/completions`: OpenAI's completions API, the subset `model`, `prompt`, `max_tokens`,
  `temperature`, `top_k`, `top_p`, `stop`, `seed`, the penalties, `n`, `logprobs`, `echo`,
  `stream`, `stream_options.include_usage` and `user` (ignored); other OpenAI fields are refused
  by name rather than silently ignored.
- `POST /v1/chat/completions`: the same subset, `echo` aside, with `messages` (rendered by the
  replica, app/serve/chat.py), `max_completion_tokens`, `logprobs` and `top_logprobs`.
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
from app.export.generate import TokenLogprob
from app.serve.protocol import json_type, parse_json
from app.serve.types import Finished, GenerationRequest, Piece, bad

PENALTIES = ("presence_penalty", "frequency_penalty")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "stop", "seed", *PENALTIES)
MAX_STOP_STRINGS = 4  # as OpenAI
MIN_TEMPERATURE = 1e-6
DONE = b"data: [DONE]\n\n"


def _number(value: Any, field: str, integer: bool) -> float | int:
    # bool is an int in Python, never a number in JSON.
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if not ok or isinstance(value, bool):
        raise bad(
            f"{field}: expected {'an integer' if integer else 'a number'}, got {json_type(value)}"
        )
    return value


def sampling(body: dict[str, Any], prefix: str, cfg: ServeConfig) -> dict[str, Any]:
    """Validated sampling fields of `body` (absent or null: the defaults), as the keyword
    arguments of app.export.generate.SamplingParams. `prefix` names where they sit ("", "parameters.")."""
    out: dict[str, Any] = {"max_tokens": cfg.generation.default_max_tokens, "temperature": 1.0}
    get = {k: body.get(k) for k in SAMPLING_FIELDS}
    if get["max_tokens"] is not None:
        n = _number(get["max_tokens"], f"{prefix}max_tokens", integer=True)
        if not 1 <= n <= cfg.generation.max_tokens:
            raise bad(
                f"{prefix}max_tokens: {n} is outside 1..{cfg.generation.max_tokens} (serve.generation.max_tokens)"
            )
        out["max_tokens"] = n
    if get["temperature"] is not None:
        t = float(_number(get["temperature"], f"{prefix}temperature", integer=False))
        if not 0 <= t <= 2:
            raise bad(f"{prefix}temperature: {t:g} is outside 0..2")
        # Below this, 1/t overflows the logits: sampling that cold is greedy decoding.
        out["temperature"] = t if t >= MIN_TEMPERATURE else 0.0
    if get["top_k"] is not None:
        k = _number(get["top_k"], f"{prefix}top_k", integer=True)
        if k < 0:
            raise bad(f"{prefix}top_k: {k} is negative (0 turns it off)")
        out["top_k"] = k
    if get["top_p"] is not None:
        p = float(_number(get["top_p"], f"{prefix}top_p", integer=False))
        if not 0 < p <= 1:
            raise bad(f"{prefix}top_p: {p:g} is outside (0, 1]")
        out["top_p"] = p
    if get["seed"] is not None:
        out["seed"] = _number(get["seed"], f"{prefix}seed", integer=True)
        if out["seed"] < 0:
            raise bad(f"{prefix}seed: {out['seed']} is negative")
    if get["stop"] is not None:
        out["stop"] = stop_strings(get["stop"], f"{prefix}stop")
    for name in PENALTIES:
        if get[name] is not None:
            value = float(_number(get[name], f"{prefix}{name}", integer=False))
            if not -2 <= value <= 2:
                raise bad(f"{prefix}{name}: {value:g} is outside -2..2")
            out[name] = value
    return out


def stop_strings(value: Any, field: str) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"{field}: expected a non-empty string or a list of them, got {json_type(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"{field}: {len(stops)} strings, at most {MAX_STOP_STRINGS}")
    return tuple(stops)


def _object(body: bytes) -> dict[str, Any]:
    request = parse_json(body)
    if not isinstance(request, dict):
        raise bad(f"body: expected a JSON object, got {json_type(request)}")
    return request


def _unknown(request: dict[str, Any], known: tuple[str, ...], prefix: str = "") -> None:
    extra = sorted(set(request) - set(known))
    if extra:  # the client's key, escaped: it goes into the answer and the log line
        name = json.dumps(extra[0][:64])
        raise bad(f"{prefix}{name}: not supported (supported: {', '.join(known)})")


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


# `user` changes nothing (accepted and ignored, as documented).
OPENAI_FIELDS = ("model", "stream", "stream_options", "user", "n", "logprobs", *SAMPLING_FIELDS)
MAX_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20  # completions' `logprobs`, chat's `top_logprobs` (OpenAI)


def parse_completion(body: bytes, cfg: ServeConfig) -> Completion:
    """The body of `POST /v1/completions`."""
    request = _object(body)
    _unknown(request, ("prompt", "echo", *OPENAI_FIELDS))
    prompt = prompt_text(request.get("prompt"), "prompt")
    logprobs = None
    if request.get("logprobs") is not None:
        logprobs = int(_number(request["logprobs"], "logprobs", integer=True))
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs: {logprobs} is outside 0..{MAX_LOGPROBS}")
    echo = flag(request.get("echo"), "echo")
    if echo and logprobs is not None:
        raise bad("logprobs: not supported with echo (the prompt's own logprobs)")
    return replace(_completion(request, prompt, cfg, logprobs), echo=echo)


def parse_chat(body: bytes, cfg: ServeConfig) -> Completion:
    """The body of `POST /v1/chat/completions`: `messages`, rendered into one prompt by the
    replica with its model's chat template (app/serve/chat.py)."""
    request = _object(body)
    _unknown(request, ("messages", "max_completion_tokens", "top_logprobs", *OPENAI_FIELDS))
    if request.get("max_completion_tokens") is not None:
        if request.get("max_tokens") is not None:
            raise bad("max_completion_tokens: give it or max_tokens, not both")
        request = {**request, "max_tokens": request["max_completion_tokens"]}
    logprobs = None
    if flag(request.get("logprobs"), "logprobs"):
        logprobs = 0
        if request.get("top_logprobs") is not None:
            logprobs = int(_number(request["top_logprobs"], "top_logprobs", integer=True))
            if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
                raise bad(f"top_logprobs: {logprobs} is outside 0..{MAX_TOP_LOGPROBS}")
    elif request.get("top_logprobs") is not None:
        raise bad("top_logprobs: only with logprobs: true")
    completion = _completion(request, "", cfg, logprobs)
    messages = chat_messages(request.get("messages"))
    generation = replace(completion.request, field="messages", messages=messages)
    return replace(completion, request=generation)


def _completion(
    request: dict[str, Any], prompt: str, cfg: ServeConfig, logprobs: int | None
) -> Completion:
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise bad(f"model: expected a model name (string), got {json_type(model)}")
    n = 1 if request.get("n") is None else _number(request["n"], "n", integer=True)
    if not 1 <= n <= cfg.generation.max_streams:
        raise bad(
            f"n: {n} is outside 1..{cfg.generation.max_streams} (serve.generation.max_streams)"
        )
    stream = flag(request.get("stream"), "stream")
    params = sampling(request, "", cfg) | ({} if logprobs is None else {"logprobs": logprobs})
    generation = GenerationRequest(prompt, params)
    return Completion(model, stream, generation, stream_usage(request, stream), n=int(n))


def stream_usage(request: dict[str, Any], stream: bool) -> bool:
    options = request.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad("stream_options: only with stream: true")
    if not isinstance(options, dict):
        raise bad(f"stream_options: expected an object, got {json_type(options)}")
    _unknown(options, ("include_usage",), "stream_options.")
    return flag(options.get("include_usage"), "stream_options.include_usage")


CHAT_ROLES = ("system", "developer", "user", "assistant")


def chat_messages(messages: Any) -> tuple[dict[str, str], ...]:
    """Validated chat messages as {"role", "content"} (content given as text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise bad(f"messages: expected a non-empty list, got {json_type(messages)}")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where}: expected an object, got {json_type(message)}")
        _unknown(message, ("role", "content", "name"), f"{where}.")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role: expected one of {', '.join(CHAT_ROLES)}, got {role!r}"[:200])
        content = _content(message.get("content"), f"{where}.content")
        out.append({"role": str(role), "content": content})
    return tuple(out)


def _content(value: Any, field: str) -> str:
    """A message's text: a string, or OpenAI's list of `{"type": "text", "text": ...}` parts."""
    if isinstance(value, list) and value:
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else json_type(part)
                raise bad(f"{field}[{i}]: only text parts are supported, got {kind!r}"[:200])
            _unknown(part, ("type", "text"), f"{field}[{i}].")
            texts.append(prompt_text(part.get("text"), f"{field}[{i}].text"))
        return "".join(texts)
    return prompt_text(value, field)


def parse_generate(body: bytes, cfg: ServeConfig) -> GenerationRequest:
    """The body of Triton's `POST /v2/models/{name}/generate[_stream]`."""
    request = _object(body)
    _unknown(request, ("text_input", "parameters", "id"))
    params = request.get("parameters") or {}
    if not isinstance(params, dict):
        raise bad(f"parameters: expected an object, got {json_type(params)}")
    _unknown(params, (*SAMPLING_FIELDS, "stream"), "parameters.")
    prompt = prompt_text(request.get("text_input"), "text_input")
    return GenerationRequest(prompt, sampling(params, "parameters.", cfg), field="text_input")


def prompt_text(value: Any, field: str) -> str:
    if isinstance(value, list) and len(value) == 1:  # OpenAI's list form, one prompt
        value = value[0]
    if not isinstance(value, str):
        raise bad(f"{field}: expected a string, got {json_type(value)}")
    if not value:
        raise bad(f"{field}: must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{field}: not valid Unicode (a lone surrogate)") from None
    return value


def flag(value: Any, field: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{field}: expected true or false, got {json_type(value)}")
    return value


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
        offsets, at = [], self.offsets.get(index, 0)
        for token in piece.logprobs:
            offsets.append(at)
            at += len(token.token)
        self.offsets[index] = self.offsets.get(index, 0) + len(piece.text)
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
