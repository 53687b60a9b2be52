"""Task `retrieval`: what the pipeline does once the model serves (the val pictures embedded,
indexed and the index deployed) and its sample request (a caption and its picture embedded,
the caption searched)."""

from __future__ import annotations

import json
import logging
from typing import Any

import requests

from app.config import Config
from app.data.ingest import iter_shards
from app.data.kinds.image_text import IMAGE_ID
from app.data.prepare import read_manifest, split_files
from app.errors import UserError

log = logging.getLogger(__name__)


def index_val_pictures(config: Config, stages: dict[str, Any]) -> dict[str, Any]:
    """Task `retrieval`: the val pictures embedded by the exported model (jobs.predict), indexed
    (jobs.index) and the index deployed (jobs.deploy), under `<train.storage_path>/<workload>-index`."""
    from app import storage
    from app.predict.driver import predict
    from app.serve.control.deploy import deploy
    from app.tasks.index.build import build_index
    from app.tasks.retrieval.val_pictures import val_pictures

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
