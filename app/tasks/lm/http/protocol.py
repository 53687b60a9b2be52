"""The generation request bodies as strict pydantic models: OpenAI's `POST /v1/completions` and
`/v1/chat/completions`, Triton's `POST /v2/models/{name}/generate[_stream]`.

Bounds that come from the deployment (`serve.generation.*`) are checked against the
`ServeConfig` passed as validation context (app/serve/http/protocol.py: strictness and the
one-line refusal). The models are the definition the fuzz test enumerates
(tests/unit/test_request_fuzz.py): a field added here is fuzzed too."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from app.config import ServeConfig
from app.data.checks import json_type
from app.serve.http.protocol import INT64, Number, Strict, prompt_text, quoted, serve_config, short

MAX_STOP_STRINGS = 4  # as OpenAI


MAX_STOP_CHARS = 256  # each stop string: it is searched for in every piece of text


MIN_TEMPERATURE = 1e-6  # below it 1/t overflows the logits: sampling that cold is greedy


MAX_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20  # completions' `logprobs`, chat's `top_logprobs` (OpenAI)


def _generation(info: ValidationInfo) -> Any:
    return serve_config(info).generation


def within_max_tokens(value: int | None, info: ValidationInfo) -> int | None:
    limit = _generation(info).max_tokens
    if value is not None and value > limit:
        raise ValueError(f"{short(value)} is over {limit} (serve.generation.max_tokens)")
    return value


class Sampling(Strict):
    """How to pick each token (absent or null: the default), as OpenAI names the fields."""

    max_tokens: int | None = Field(None, ge=1)  # at most serve.generation.max_tokens
    temperature: Number | None = Field(None, ge=0, le=2)
    top_k: int | None = Field(None, ge=0, lt=INT64)  # 0: off
    top_p: Number | None = Field(None, gt=0, le=1)
    stop: Any = None  # a non-empty string or a list of at most 4
    seed: int | None = Field(None, ge=0, lt=INT64)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        return within_max_tokens(value, info)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(
                f"expected a non-empty string or a list of them, got {json_type(value)}"
            )
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stops)} strings, at most {MAX_STOP_STRINGS}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is longer than {MAX_STOP_CHARS} characters")
        return tuple(stops)

    def params(self, cfg: ServeConfig) -> dict[str, Any]:
        """The keyword arguments of app.runtime.decoding.SamplingParams."""
        out: dict[str, Any] = {
            "max_tokens": self.max_tokens or cfg.generation.default_max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
        }
        if out["temperature"] < MIN_TEMPERATURE:
            out["temperature"] = 0.0
        for name in ("top_k", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


class StreamOptions(Strict):
    include_usage: bool | None = None


class OpenAIRequest(Sampling):
    model: str = Field(min_length=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as documented
    n: int | None = Field(None, ge=1)  # at most serve.generation.max_streams

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None, info: ValidationInfo) -> int | None:
        limit = _generation(info).max_streams
        if value is not None and value > limit:
            raise ValueError(f"{short(value)} is over {limit} (serve.generation.max_streams)")
        return value

    @model_validator(mode="after")
    def _options_with_stream(self) -> OpenAIRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream: true")
        return self

    @model_validator(mode="after")
    def _request_tokens(self, info: ValidationInfo) -> OpenAIRequest:
        cfg = serve_config(info)
        limit = cfg.generation.max_request_tokens
        tokens = self.params(cfg)["max_tokens"]  # what the request really asks, default included
        if (self.n or 1) * tokens > limit:
            named = (
                "max_completion_tokens"
                if "max_completion_tokens" in self.model_fields_set
                else "max_tokens"
            )
            raise ValueError(
                f"n: {self.n or 1} completions x {named} {tokens} is over {limit} tokens "
                "(serve.generation.max_request_tokens)"
            )
        return self


class CompletionRequest(OpenAIRequest):
    prompt: Any  # a non-empty string (or OpenAI's list form holding one)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str:
        return prompt_text(value)

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("logprobs: not supported with echo (the prompt's own logprobs)")
        return self


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any  # a string, or OpenAI's list of {"type": "text", "text": ...} parts
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str:
        """The message's text (text parts joined)."""
        if not isinstance(value, list) or not value:
            return prompt_text(value)
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else json_type(part)
                raise ValueError(f"part {i}: only text parts are supported, got {quoted(kind)}")
            if set(part) - {"type", "text"}:
                extra = sorted(set(part) - {"type", "text"})[0]
                raise ValueError(f"part {i}: {quoted(extra)} is not supported")
            try:
                texts.append(prompt_text(part.get("text")))
            except ValueError as e:
                raise ValueError(f"part {i}: text {e}") from None
        return "".join(texts)


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _one_length(self) -> ChatRequest:
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            raise ValueError("max_completion_tokens: give it or max_tokens, not both")
        return self

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        return within_max_tokens(value, info)

    def params(self, cfg: ServeConfig) -> dict[str, Any]:
        out = super().params(cfg)
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        return out

    @model_validator(mode="after")
    def _top_with_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only with logprobs: true")
        return self

    def logprob_count(self) -> int | None:
        """Alternatives per token when logprobs are asked for (None: not asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateParameters(Sampling):
    stream: bool | None = None  # the route decides; accepted as Triton's clients send it


class GenerateRequest(Strict):
    text_input: Any
    parameters: GenerateParameters | None = None
    id: str | None = None

    @field_validator("text_input")
    @classmethod
    def _text(cls, value: Any) -> str:
        return prompt_text(value)
