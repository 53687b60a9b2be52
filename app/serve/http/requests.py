"""The generation request bodies as strict pydantic models: OpenAI's `POST /v1/completions` and
`/v1/chat/completions`, Triton's `POST /v2/models/{name}/generate[_stream]`.

Strict: no string or boolean is taken for a number, no inf or NaN, a number beyond a field's
range (a 400-digit integer included) is refused, and an unknown field is refused by name
rather than silently ignored. Bounds that come from the deployment (`serve.generation.*`) are
checked against the `ServeConfig` passed as validation context. A refusal is one
`RequestError` line naming the dotted field (`messages[0].content: ...`).

The models are the definition the fuzz test enumerates (tests/unit/test_request_fuzz.py): a
field added here is fuzzed too.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from app.config import ServeConfig
from app.data.checks import json_type
from app.runtime.types import RequestError, bad
from app.serve.http.gate import parse_json

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # each stop string: it is searched for in every piece of text
MIN_TEMPERATURE = 1e-6  # below it 1/t overflows the logits: sampling that cold is greedy
MAX_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20  # completions' `logprobs`, chat's `top_logprobs` (OpenAI)
INT64 = 2**63

Number = Annotated[float, Field(allow_inf_nan=False)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class TooLarge(ValueError):
    """A field over a deployment limit (`serve.*`): the refusal is a 413, not a 400."""


def _serve(info: ValidationInfo) -> ServeConfig:
    return (info.context or {}).get("cfg") or ServeConfig()


def _generation(info: ValidationInfo) -> Any:
    return _serve(info).generation


def within_max_tokens(value: int | None, info: ValidationInfo) -> int | None:
    limit = _generation(info).max_tokens
    if value is not None and value > limit:
        raise ValueError(f"{_short(value)} is over {limit} (serve.generation.max_tokens)")
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
            raise ValueError(f"{_short(value)} is over {limit} (serve.generation.max_streams)")
        return value

    @model_validator(mode="after")
    def _options_with_stream(self) -> OpenAIRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream: true")
        return self

    @model_validator(mode="after")
    def _request_tokens(self, info: ValidationInfo) -> OpenAIRequest:
        cfg = _serve(info)
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
                raise ValueError(f"part {i}: only text parts are supported, got {_quoted(kind)}")
            if set(part) - {"type", "text"}:
                extra = sorted(set(part) - {"type", "text"})[0]
                raise ValueError(f"part {i}: {_quoted(extra)} is not supported")
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


def prompt_text(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:  # OpenAI's list form, one prompt
        value = value[0]
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {json_type(value)}")
    if not value:
        raise ValueError("must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode (a lone surrogate)") from None
    return value


def read(body: bytes, model: type[Strict], cfg: ServeConfig) -> Any:
    """A request body as `model`, or a RequestError naming the first field that is wrong."""
    request = parse_json(body)
    if not isinstance(request, dict):
        raise bad(f"body: expected a JSON object, got {json_type(request)}")
    try:
        return model.model_validate(request, context={"cfg": cfg})
    except ValidationError as e:
        raise refusal(e, model) from None


def refusal(error: ValidationError, model: type[BaseModel]) -> RequestError:
    """One line naming the dotted field: what is wrong with it (and the value, if short)."""
    first = error.errors(include_url=False)[0]
    where = field_path(first["loc"])
    if first["type"] == "extra_forbidden":
        return bad(f"{unknown(first['loc'])}: not supported")
    if first["type"] == "string_unicode" and not where:  # a key that is not valid Unicode
        return bad(f"{unknown((str(first['input']),))}: not supported")
    message = first["msg"].removeprefix("Value error, ")
    status = 413 if isinstance((first.get("ctx") or {}).get("error"), TooLarge) else 400
    if message.split(":", 1)[0] in model.model_fields:  # a validator that names its field
        return bad(message, status)
    if where and first["type"] == "value_error" and message.startswith("["):  # an item of it
        return bad(f"{where}{message}", status)
    return bad(f"{where}: {_what(first)}" if where else message, status)


def _what(error: Any) -> str:
    """pydantic's message for a field, with what the client sent where that helps."""
    message, value, error_type = (
        error["msg"].removeprefix("Value error, "),
        error.get("input"),
        error["type"],
    )
    message = message[0].lower() + message[1:]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if error_type == "float_type" and number:  # an integer no float can hold
        return f"{_short(value)} is out of range"
    if error_type.endswith("_type") or error_type == "finite_number":
        return f"{message}, got {json_type(value)}"
    if error_type == "literal_error" and isinstance(value, str):
        return f"{message}, got {_quoted(value)}"
    return f"{message} (got {_short(value)})" if number and error_type != "value_error" else message


def _quoted(value: Any) -> str:
    return json.dumps(value)[:64] if isinstance(value, str) else json_type(value)


def field_path(loc: tuple[int | str, ...]) -> str:
    """`("messages", 0, "content")` -> `messages[0].content`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def unknown(loc: tuple[int | str, ...]) -> str:
    """The path of a key the client made up, that key quoted and escaped (it goes into the
    answer and the log line): `stream_options."colour"`."""
    *parent, key = loc
    where = field_path(tuple(parent))
    return f"{where}.{json.dumps(str(key)[:64])}" if where else json.dumps(str(key)[:64])


def _short(value: int | float) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} characters)"


# --- embeddings (a retrieval model) --------------------------------------------------------------


class ImageURL(Strict):
    url: str
    detail: str | None = None  # OpenAI's; a picture is embedded whole either way


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class EmbeddingsRequest(Strict):
    """`POST /v1/embeddings`: OpenAI's shape; `input` a string or a list of strings and
    pictures (`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`)."""

    model: str = Field(min_length=1)
    input: Any
    encoding_format: Literal["float", "base64"] | None = None
    user: str | None = None  # accepted and ignored, as documented

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any, info: ValidationInfo) -> tuple[str | bytes, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise ValueError(f"expected a string or a non-empty list, got {json_type(value)}")
        limit = _serve(info).max_request_rows
        if len(items) > limit:
            raise TooLarge(f"{len(items)} items, more than serve.max_request_rows={limit}")
        return tuple(embedding_item(item, i) for i, item in enumerate(items))


def embedding_item(item: Any, i: int) -> str | bytes:
    """A text as it is, or a picture's bytes from its data URL (the server fetches nothing)."""
    if isinstance(item, str):
        try:
            return prompt_text(item)
        except ValueError as e:
            raise ValueError(f"[{i}]: {e}") from None
    if isinstance(item, int | list) and not isinstance(item, bool):
        raise ValueError(f"[{i}]: token ids are not supported; send the text")
    try:
        part = ImagePart.model_validate(item)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        raise ValueError(f"[{i}].{field_path(first['loc'])}: {_what(first)}") from None
    return data_url_bytes(part.image_url.url, f"[{i}].image_url.url")


def data_url_bytes(url: str, where: str) -> bytes:
    import base64
    import binascii

    if url.startswith(("http://", "https://", "ftp://", "file:")):
        raise ValueError(f"{where}: the server fetches no URL; send the picture as a data URL")
    head, comma, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64") and comma):
        raise ValueError(f"{where}: expected data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the base64 data does not decode") from None


# --- search (a vector index) ---------------------------------------------------------------------


class Query(Strict):
    """One query: exactly one of a text, a picture (a data URL), a raw embedding, a stored id."""

    text: str | None = None
    image: str | None = None
    embedding: list[Number] | None = Field(None, min_length=1, max_length=65536)
    id: str | int | None = None

    @model_validator(mode="after")
    def _one(self) -> Query:
        given = [n for n in ("text", "image", "embedding", "id") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of text, image, embedding, id (got {given or 'none'})"
            )
        if self.text is not None:
            prompt_text(self.text)
        return self


class SearchBody(Strict):
    """`POST /v1/models/{name}:search`. The number of queries is checked before any query is
    read (`serve.max_queries`), then queries x top_k (`serve.max_search_results`): both bound
    the replica's work and the answer's size."""

    queries: list[Query] | None = Field(None, min_length=1)
    query: Query | None = None
    top_k: int = Field(10, ge=1)  # at most serve.max_top_k
    filter: dict[str, str | int | float | bool] | None = None

    @field_validator("queries", mode="before")
    @classmethod
    def _count(cls, value: Any, info: ValidationInfo) -> Any:
        key, limit = _serve(info).query_limit()
        if isinstance(value, list) and len(value) > limit:
            raise TooLarge(f"{len(value)} queries, more than serve.{key}={limit}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int, info: ValidationInfo) -> int:
        limit = _serve(info).max_top_k
        if value > limit:
            raise TooLarge(f"{_short(value)} is over serve.max_top_k={limit}")
        return value

    @model_validator(mode="after")
    def _queries(self, info: ValidationInfo) -> SearchBody:
        if (self.queries is None) == (self.query is None):
            raise ValueError("queries: give `queries` (a list) or `query` (one), not both")
        limit, results = _serve(info).max_search_results, len(self.all_queries()) * self.top_k
        if results > limit:
            raise TooLarge(
                f"queries: {len(self.all_queries())} queries x top_k {self.top_k} = {results} "
                f"results, more than serve.max_search_results={limit}"
            )
        return self

    def all_queries(self) -> list[Query]:
        return self.queries or ([self.query] if self.query else [])
