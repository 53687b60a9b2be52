"""Request bodies as strict pydantic models, read and refused the same way by every endpoint
(each task's own bodies are in app/tasks/<task>/http/protocol.py).

Strict: no string or boolean is taken for a number, no inf or NaN, a number beyond a field's
range (a 400-digit integer included) is refused, and an unknown field is refused by name
rather than silently ignored. Bounds that come from the deployment (`serve.*`) are checked
against the `ServeConfig` passed as validation context. A refusal is one `RequestError` line
naming the dotted field (`messages[0].content: ...`); a field over a deployment limit is a 413.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
)

from app.config import ServeConfig
from app.data.checks import json_type
from app.runtime.types import RequestError, bad
from app.serve.http.gate import parse_json

INT64 = 2**63

Number = Annotated[float, Field(allow_inf_nan=False)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class TooLarge(ValueError):
    """A field over a deployment limit (`serve.*`): the refusal is a 413, not a 400."""


def serve_config(info: ValidationInfo) -> ServeConfig:
    return (info.context or {}).get("cfg") or ServeConfig()


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
    return bad(f"{where}: {what(first)}" if where else message, status)


def what(error: Any) -> str:
    """pydantic's message for a field, with what the client sent where that helps."""
    message, value, error_type = (
        error["msg"].removeprefix("Value error, "),
        error.get("input"),
        error["type"],
    )
    message = message[0].lower() + message[1:]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if error_type == "float_type" and number:  # an integer no float can hold
        return f"{short(value)} is out of range"
    if error_type.endswith("_type") or error_type == "finite_number":
        return f"{message}, got {json_type(value)}"
    if error_type == "literal_error" and isinstance(value, str):
        return f"{message}, got {quoted(value)}"
    return f"{message} (got {short(value)})" if number and error_type != "value_error" else message


def quoted(value: Any) -> str:
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


def short(value: int | float) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} characters)"


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
