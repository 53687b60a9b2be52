"""Task `lm`: the pipeline's sample request, streamed and timed to its first token: a chat
(`/v1/chat/completions`, the first conversation of the data up to its first answer) for a model
fine-tuned on chat data, else a completion of a code prompt (`/v1/completions`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import requests

from app.config import Config
from app.errors import UserError

log = logging.getLogger(__name__)
Piece = Callable[[dict[str, Any]], str]  # an SSE chunk's choice -> its text


def sample_completion(
    config: Config, url: str, model: str, headers: dict[str, str]
) -> dict[str, Any]:
    """Task `lm`: one streamed request, timed to its first token."""
    route, asked, piece = sample_request(config)
    endpoint = f"{url}{route}"
    body = {"model": model, **asked, "max_tokens": 32, "stream": True}
    start = time.perf_counter()
    response = requests.post(endpoint, json=body, headers=headers, stream=True, timeout=60)
    if response.status_code != 200:
        raise UserError(
            f"sample request to {endpoint} failed: HTTP {response.status_code} {response.text[:200]}"
        )
    first_token_s, pieces = None, []
    for block in response.iter_lines(delimiter=b"\n\n"):
        if not block.startswith(b"data: {"):
            continue
        pieces.append(piece(json.loads(block[6:])["choices"][0]))
        first_token_s = first_token_s or time.perf_counter() - start
    auth = ' -H "Authorization: Bearer $RAYTORCH_API_KEY"' if "Authorization" in headers else ""
    curl = f"curl -N {endpoint} -H 'Content-Type: application/json'{auth} -d '{json.dumps(body)}'"
    log.info("pipeline: sample request %s: %r", json.dumps(asked)[:200], "".join(pieces))
    return {
        "endpoint": endpoint,
        **asked,
        "completion": "".join(pieces),
        "first_token_seconds": first_token_s,
        "seconds": time.perf_counter() - start,
        "curl": curl,
    }


def sample_request(config: Config) -> tuple[str, dict[str, Any], Piece]:
    """(route, what the request asks, how a streamed chunk's text is read)."""
    if config.data.source == "chat":
        from app.data.chat_source import first_prompt

        return (
            "/v1/chat/completions",
            {"messages": first_prompt(config.data.path)},
            lambda choice: choice["delta"].get("content") or "",
        )
    return "/v1/completions", {"prompt": "def "}, lambda choice: choice["text"]
