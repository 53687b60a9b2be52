"""Pipeline: prepare -> train -> evaluate -> export -> deploy -> one sample request.

Each stage's output feeds the next by URI, exactly as the separate jobs would pass them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Protocol

import requests

from app.config import Config
from app.data.ingest import iter_shards
from app.data.kinds import processor
from app.data.prepare import read_manifest, split_files
from app.errors import UserError
from app.ray_runtime import connect_ray
from app.tasks.registry import Part, run_task


class Smoke(Protocol):
    """One real request to the deployed model (jobs.pipeline's last step): its summary."""

    def __call__(
        self, config: Config, url: str, model: str, headers: dict[str, str], /
    ) -> dict[str, Any]: ...


SMOKE = Part[Smoke]("smoke")

log = logging.getLogger(__name__)


def pipeline(config: Config) -> dict[str, Any]:
    from app.data.prepare import prepare
    from app.evaluate import evaluate
    from app.export.exporter import export
    from app.serve.control.deploy import deploy
    from app.train.driver import train

    connect_ray(require_cluster=True)  # deploy needs a cluster: find out before any work
    stages: dict[str, Any] = {}
    stages["prepare"] = prepare(config)
    stages["train"] = train(config)
    checkpoint = stages["train"]["checkpoint"]
    stages["evaluate"] = evaluate(config, checkpoint)
    stages["export"] = export(config, checkpoint)
    stages["deploy"] = deploy(config, stages["export"]["artifact"])
    url = stages["deploy"]["url"]
    sample = sample_request(config, url, stages["deploy"]["model"])
    return {"stage": "pipeline", "url": url, "stages": stages, "sample_request": sample}


def sample_body(config: Config, rows: int = 1) -> tuple[dict[str, Any], list[str]]:
    """A v2 request for the first `rows` val rows, and their true labels."""
    output = config.data_output
    manifest = read_manifest(output)
    frame = next(iter_shards(split_files(output, manifest, "val"))).iloc[:rows]
    tensor = processor(manifest.kind).sample_tensor(frame, manifest.feature_columns)
    return {"inputs": [tensor]}, frame[manifest.label_column].astype(str).tolist()


def sample_request(config: Config, url: str, model: str) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(config.serve.api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    task = run_task(config.train.task, read_manifest(config.data_output).kind)
    return task.part(SMOKE)(config, url, model, headers)


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
