"""The typed contract between the HTTP routes, the model replicas, batch inference and tests.

A request crosses a process boundary (a DeploymentHandle call) only as these types; a problem
with it is a `RequestError` raised (never returned in a result), which the routes answer as
JSON with its status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np


class RequestError(Exception):
    """A request the model cannot answer: its HTTP status and a message naming the field."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None):
        super().__init__(status, message, retry_after_s)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s

    def __str__(self) -> str:
        return self.message


def bad(message: str, status: int = 400) -> RequestError:
    return RequestError(status, message)


@dataclass(frozen=True, slots=True)
class Tensor:
    """One Open Inference Protocol v2 input tensor as the client sent it (checked for form, not
    yet against the model's schema)."""

    name: str
    datatype: str
    shape: list[int]
    data: Any  # nested lists, a flat list, or a numpy array from the binary extension


@dataclass(frozen=True, slots=True)
class InferRequest:
    """Rows for a classifier: a v2 tensor or v1 instances (one instance per row)."""

    tensor: Tensor | None = None
    instances: list[Any] | None = None


@dataclass(frozen=True, slots=True)
class InferResult:
    labels: list[str]
    probabilities: np.ndarray  # [rows, classes]
    version: str
    label_names: list[str]
    replica_pid: int


@dataclass(frozen=True)
class ModelInfo:
    """What a replica says about the model it serves (`GET /v2/models/{name}`, `/v1/models`)."""

    name: str
    version: str
    variant: str
    artifact: str
    task: str
    generates: bool  # answers /v1/completions and the generate extension, not /infer
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    labels: list[str]
    manifest: dict[str, Any]
    replica_pid: int
    batching: dict[str, Any] | None = None  # classifiers: how batched requests share calls
    generation: dict[str, int] | None = None  # language models: streams running, tokens
    embeds: bool = False  # answers /v1/embeddings (a retrieval model)
    searches: bool = False  # answers /v1/models/{name}:search (a vector index)

    def listing(self) -> dict[str, Any]:
        """The model's entry in `GET /v1/models`."""
        entry = {
            "name": self.name,
            "version": self.version,
            "variant": self.variant,
            "artifact": self.artifact,
            "task": self.task,
            "manifest": self.manifest,
        }
        return entry | ({"batching": self.batching} if self.batching is not None else {})


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: str
    params: dict[str, Any]  # app.runtime.decoding.SamplingParams keyword arguments
    field: str = "prompt"  # the request field the prompt came in, for error messages
    # Chat messages ({"role", "content"} each), rendered into the prompt by the replica with
    # its model's chat template; `prompt` is then unused.
    messages: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Started:
    prompt_tokens: int
    version: str


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token as OpenAI's `logprobs` report it: its text and UTF-8 bytes, its
    log-probability under the model (before temperature, top-k/top-p and penalties, as vLLM
    reports them) and the `top` most likely tokens at that position, most likely first."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens behind `text`, when asked for


# How a generation that ran to its end ended: end of text or a stop string; max_tokens or the
# model's window. (A stream that could not finish raises its RequestError instead.)
FinishReason = Literal["stop", "length"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    version: str

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """Inputs to embed, in order: a text (str) or a picture (its encoded bytes) each. `field`
    names the request field they came in, for error messages (`input[2]`)."""

    items: tuple[str | bytes, ...]
    field: str = "input"


@dataclass(frozen=True, slots=True)
class EmbedResult:
    embeddings: np.ndarray  # float32 [items, dim], L2-normalised
    tokens: int  # text tokens read (OpenAI's usage)
    version: str
    replica_pid: int = 0  # the process that answered (the x-model-replica header)


@dataclass(frozen=True, slots=True)
class SearchQuery:
    """One query: exactly one of a text, a picture's bytes, an embedding or a stored id."""

    text: str | None = None
    image: bytes | None = None
    embedding: np.ndarray | None = None  # a vector, any float dtype
    id: str | None = None


@dataclass(frozen=True, slots=True)
class SearchRequest:
    queries: tuple[SearchQuery, ...]
    top_k: int
    filter: tuple[tuple[str, Any], ...] = ()  # equality on stored metadata, all must hold


@dataclass(frozen=True, slots=True)
class SearchResult:
    hits: list[list[dict[str, Any]]]  # per query: {"id", "score", "metadata"} best first
    version: str  # the index's
    encoder_version: str
    replica_pid: int = 0  # the process that answered (the x-model-replica header)


# A generation is Started, then a Piece per piece of text, then Finished.
GenerationEvent = Started | Piece | Finished
