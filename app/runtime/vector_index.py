"""A vector index artifact, as search reads it: `<registry>/<model>/index/<version>/`.

    index.faiss     the faiss index of the items' embeddings (inner product: cosine, as the
                    embeddings are L2-normalised)
    items.parquet   one row per vector, in index order: `id` and the stored metadata columns
    thumbnails.parquet  (with `index.thumbnails`) one JPEG or null per vector, in index order
    schema.json     task "index", method, embed_dim, metadata columns, and the encoder artifact
                    (URI of its version folder, name, version) whose embeddings these are
    report.json     vectors, build time, peak memory, recall@10 against exact search
    manifest.json   the sha256 of every file, written last (app/runtime/artifact.py's contract)

Opening one checks every file's sha256 before reading anything, as an artifact's.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from app.errors import ArtifactError
from app.runtime.artifact import ArtifactManifest, open_verified

INDEX_FILE, ITEMS_FILE, THUMBNAILS_FILE = "index.faiss", "items.parquet", "thumbnails.parquet"
THUMBNAIL = "thumbnail"  # jobs.predict's column and the thumbnails file's: JPEG bytes or null
THUMBNAILS_SCHEMA = pa.schema([(THUMBNAIL, pa.binary())])
INDEX_TASK = "index"


@dataclass
class VectorIndex:
    uri: str
    manifest: ArtifactManifest
    schema: dict[str, Any]
    report: dict[str, Any]
    index: Any  # a faiss index
    items: pa.Table
    thumbnails: pa.ChunkedArray | None = None  # JPEG bytes or null, in index order

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return str(self.manifest.version)

    @property
    def encoder(self) -> dict[str, str]:
        return self.schema["encoder"]

    @property
    def dim(self) -> int:
        return int(self.schema["embed_dim"])


def open_index(uri: str) -> VectorIndex:
    import faiss

    uri, manifest, files = open_verified(uri)
    for name in (INDEX_FILE, ITEMS_FILE, "schema.json", "report.json"):
        if name not in files:
            raise ArtifactError(f"{name}: not listed in the manifest of {uri}")
    schema = json.loads(files["schema.json"])
    if schema.get("task") != INDEX_TASK:
        raise ArtifactError(f"{uri}: not a vector index (schema.json task {schema.get('task')!r})")
    index = faiss.deserialize_index(np.frombuffer(files[INDEX_FILE], dtype=np.uint8))
    items = pq.read_table(io.BytesIO(files[ITEMS_FILE]))
    if index.ntotal != items.num_rows:
        raise ArtifactError(f"{uri}: {index.ntotal} vectors but {items.num_rows} items")
    thumbnails = None
    if THUMBNAILS_FILE in files:
        thumbnails = pq.read_table(io.BytesIO(files[THUMBNAILS_FILE]))[THUMBNAIL]
        if len(thumbnails) != index.ntotal:
            raise ArtifactError(f"{uri}: {index.ntotal} vectors but {len(thumbnails)} thumbnails")
    report = json.loads(files["report.json"])
    return VectorIndex(uri, manifest, schema, report, index, items, thumbnails)


def set_search_params(index: Any, ef_search: int, nprobe: int) -> None:
    if hasattr(index, "hnsw"):
        index.hnsw.efSearch = ef_search
    if hasattr(index, "nprobe"):
        index.nprobe = nprobe
