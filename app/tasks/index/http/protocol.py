"""`POST /v1/models/{name}:search` bodies: queries by text, picture, embedding or item id, with
an optional exact filter on the metadata."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from app.serve.http.protocol import Number, Strict, TooLarge, prompt_text, serve_config, short

B64_FLOATS = 4 * (65536 * 4 // 3 + 1)  # the base64 of 65,536 float32


class Query(Strict):
    """One query: exactly one of a text, a picture (a data URL), a raw embedding, a stored id."""

    text: str | None = None
    image: str | None = None
    # Numbers, or with the body's `encoding_format: "base64"` a string of little-endian
    # float32 (what OpenAI's embeddings answer with it), read without a number at a time.
    embedding: (
        Annotated[list[Number], Field(min_length=1, max_length=65536)]
        | Annotated[str, Field(min_length=1, max_length=B64_FLOATS)]
        | None
    ) = None
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
    encoding_format: Literal["float", "base64"] = "float"  # of the queries' embeddings

    @field_validator("queries", mode="before")
    @classmethod
    def _count(cls, value: Any, info: ValidationInfo) -> Any:
        key, limit = serve_config(info).query_limit()
        if isinstance(value, list) and len(value) > limit:
            raise TooLarge(f"{len(value)} queries, more than serve.{key}={limit}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int, info: ValidationInfo) -> int:
        limit = serve_config(info).max_top_k
        if value > limit:
            raise TooLarge(f"{short(value)} is over serve.max_top_k={limit}")
        return value

    @model_validator(mode="after")
    def _queries(self, info: ValidationInfo) -> SearchBody:
        if (self.queries is None) == (self.query is None):
            raise ValueError("queries: give `queries` (a list) or `query` (one), not both")
        for i, query in enumerate(self.all_queries()):
            if query.embedding is not None and isinstance(query.embedding, str) != (
                self.encoding_format == "base64"
            ):
                want = (
                    "a list, but encoding_format is 'base64' (send a base64 string of float32)"
                    if self.encoding_format == "base64"
                    else "a string, but encoding_format is 'float' (send numbers, or a base64 "
                    "string with encoding_format 'base64')"
                )
                raise ValueError(f"queries[{i}].embedding: {want}")
        limit, results = serve_config(info).max_search_results, len(self.all_queries()) * self.top_k
        if results > limit:
            raise TooLarge(
                f"queries: {len(self.all_queries())} queries x top_k {self.top_k} = {results} "
                f"results, more than serve.max_search_results={limit}"
            )
        return self

    def all_queries(self) -> list[Query]:
        return self.queries or ([self.query] if self.query else [])
