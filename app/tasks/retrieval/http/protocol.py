"""OpenAI's `POST /v1/embeddings` body: texts and pictures (data URLs) alike."""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from app.data.checks import json_type
from app.serve.http.protocol import Strict, TooLarge, field_path, prompt_text, serve_config, what


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
        limit = serve_config(info).max_request_rows
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
        raise ValueError(f"[{i}].{field_path(first['loc'])}: {what(first)}") from None
    return data_url_bytes(part.image_url.url, f"[{i}].image_url.url")


def data_url_bytes(url: str, where: str) -> bytes:
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
