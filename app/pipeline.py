"""Pipeline: prepare -> train -> evaluate -> export -> deploy -> the task's follow-up stages
(retrieval: embed the val pictures, index them, deploy the index) -> one sample request.

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
from app.data.kinds.image_text import IMAGE_ID
from app.data.pieces import Tasks
from app.data.prepare import prepare_dataset, read_manifest, split_files
from app.errors import UserError
from app.ray_runtime import connect_ray
from app.tasks.registry import Part, run_task


class Smoke(Protocol):
    """One real request to the deployed model (jobs.pipeline's last step): its summary."""

    def __call__(
        self, config: Config, url: str, model: str, headers: dict[str, str], /
    ) -> dict[str, Any]: ...


SMOKE = Part[Smoke]("smoke")


class FollowUp(Protocol):
    """Stages a task runs once its model serves, given the pipeline's stages so far: their
    summaries by stage name."""

    def __call__(self, config: Config, stages: dict[str, Any], /) -> dict[str, Any]: ...


FOLLOW_UP = Part[FollowUp]("follow_up")

log = logging.getLogger(__name__)


def prepare(config: Config, tasks: Tasks | None = None) -> dict[str, Any]:
    """jobs.prepare: the data layer's `prepare_dataset` with the run's pretrained folders (their
    tokenizer, and the check that they take the data) handed down from the model families."""
    from app.models.families import Bases  # torch: the driver only

    return prepare_dataset(config, Bases(config.model), tasks)


def pipeline(config: Config) -> dict[str, Any]:
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
    task = run_task(config.train.task, read_manifest(config.data_output).kind)
    if task.has(FOLLOW_UP):
        stages |= task.part(FOLLOW_UP)(config, stages)
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


def index_val_pictures(config: Config, stages: dict[str, Any]) -> dict[str, Any]:
    """Task `retrieval`: the val pictures embedded by the exported model (jobs.predict), indexed
    (jobs.index) and the index deployed (jobs.deploy), under `<train.storage_path>/<workload>-index`."""
    from app import storage
    from app.corpus import val_pictures
    from app.index import build_index
    from app.predict.driver import predict
    from app.serve.control.deploy import deploy

    folder = storage.join(config.storage_path, f"{config.workload}-index")
    corpus = val_pictures(config, storage.join(folder, "corpus"))
    embeddings = storage.join(folder, "embeddings")
    predicted = predict(config, stages["export"]["artifact"], corpus, embeddings, overwrite=True)
    index = build_index(config, embeddings)
    return {"predict": predicted, "index": index, "deploy_index": deploy(config, index["artifact"])}


def index_name(config: Config, model: str) -> str:
    return config.index.name or f"{model}-index"


def sample_embedding(
    config: Config, url: str, model: str, headers: dict[str, str]
) -> dict[str, Any]:
    """Task `retrieval`: a val caption and its picture embedded; how similar the two are."""
    import base64

    output = config.data_output
    manifest = read_manifest(output)
    row = next(iter_shards(split_files(output, manifest, "val"))).iloc[0]
    image, caption = (row[c] for c in manifest.feature_columns[:2])
    url_of = "data:image/png;base64," + base64.b64encode(bytes(image)).decode()
    picture = {"type": "image_url", "image_url": {"url": url_of}}
    body = {"model": model, "input": [caption, picture]}
    endpoint = f"{url}/v1/embeddings"
    response = requests.post(endpoint, json=body, headers=headers, timeout=60)
    if response.status_code != 200:
        raise UserError(
            f"sample request to {endpoint} failed: HTTP {response.status_code} {response.text[:200]}"
        )
    text_emb, image_emb = (d["embedding"] for d in response.json()["data"])
    similarity = float(sum(a * b for a, b in zip(text_emb, image_emb, strict=True)))
    log.info("pipeline: %r and its picture embedded, cosine %.3f", caption, similarity)
    found = sample_search(url, index_name(config, model), caption, headers)
    picture_id = str(row[IMAGE_ID])
    log.info(
        "pipeline: search for %r: its picture %s is hit %s",
        caption,
        picture_id,
        found["ids"].index(picture_id) + 1 if picture_id in found["ids"] else "not in the top 5",
    )
    auth = ' -H "Authorization: Bearer $RAYTORCH_API_KEY"' if "Authorization" in headers else ""
    shown = json.dumps({"query": {"text": caption}, "top_k": 5})
    curl = f"curl -s {found['endpoint']} -H 'Content-Type: application/json'{auth} -d '{shown}'"
    return {
        "endpoint": endpoint,
        "caption": caption,
        "cosine": similarity,
        "search": found["endpoint"],
        "picture": picture_id,
        "hits": found["ids"],
        "curl": curl,
    }


def sample_search(url: str, index: str, caption: str, headers: dict[str, str]) -> dict[str, Any]:
    endpoint = f"{url}/v1/models/{index}:search"
    body = {"query": {"text": caption}, "top_k": 5}
    response = requests.post(endpoint, json=body, headers=headers, timeout=60)
    if response.status_code != 200:
        raise UserError(
            f"sample request to {endpoint} failed: HTTP {response.status_code} {response.text[:200]}"
        )
    ids = [str(hit["id"]) for hit in response.json()["results"][0]]
    return {"endpoint": endpoint, "ids": ids}
