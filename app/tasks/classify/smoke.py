"""Task `classify`: the pipeline's sample request, one v2 inference on a val row."""

from __future__ import annotations

import json
import logging
from typing import Any

import requests

from app.config import Config
from app.data.ingest import iter_shards
from app.data.kinds import processor
from app.data.prepare import read_manifest, split_files
from app.errors import UserError

log = logging.getLogger(__name__)


def sample_body(config: Config, rows: int = 1) -> tuple[dict[str, Any], list[str]]:
    """A v2 request for the first `rows` val rows, and their true labels."""
    output = config.data_output
    manifest = read_manifest(output)
    frame = next(iter_shards(split_files(output, manifest, "val"))).iloc[:rows]
    tensor = processor(manifest.kind).sample_tensor(frame, manifest.feature_columns)
    return {"inputs": [tensor]}, frame[manifest.label_column].astype(str).tolist()


def sample_infer(config: Config, url: str, model: str, headers: dict[str, str]) -> dict[str, Any]:
    """Task `classify`: one v2 inference on a val row, with its true label beside the answer."""
    key = headers.get("Authorization")
    body, expected = sample_body(config)
    endpoint = f"{url}/v2/models/{model}/infer"
    response = requests.post(endpoint, json=body, headers=headers, timeout=30)
    if response.status_code != 200:
        raise UserError(
            f"sample request to {endpoint} failed: HTTP {response.status_code} {response.text[:200]}"
        )
    label = response.json()["outputs"][0]["data"]
    auth = ' -H "Authorization: Bearer $RAYTORCH_API_KEY"' if key else ""
    curl = f"curl -s {endpoint} -H 'Content-Type: application/json'{auth} -d '{json.dumps(body)}'"
    log.info("pipeline: sample request answered %s (true label %s)", label, expected)
    return {"endpoint": endpoint, "predicted": label, "expected": expected, "curl": curl}
