"""Task `lm`: the pipeline's sample request, one streamed completion."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import requests

from app.config import Config
from app.errors import UserError

log = logging.getLogger(__name__)


def sample_completion(
    config: Config, url: str, model: str, headers: dict[str, str]
) -> dict[str, Any]:
    """Task `lm`: one streamed completion, timed to its first token."""
    endpoint = f"{url}/v1/completions"
    body = {"model": model, "prompt": "def ", "max_tokens": 32, "stream": True}
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
        pieces.append(json.loads(block[6:])["choices"][0]["text"])
        first_token_s = first_token_s or time.perf_counter() - start
    auth = ' -H "Authorization: Bearer $RAYTORCH_API_KEY"' if "Authorization" in headers else ""
    curl = f"curl -N {endpoint} -H 'Content-Type: application/json'{auth} -d '{json.dumps(body)}'"
    log.info("pipeline: sample completion of %r: %r", body["prompt"], "".join(pieces))
    return {
        "endpoint": endpoint,
        "prompt": body["prompt"],
        "completion": "".join(pieces),
        "first_token_seconds": first_token_s,
        "seconds": time.perf_counter() - start,
        "curl": curl,
    }
