"""Index: a retrieval model's embeddings of a corpus (jobs.predict's output) -> a versioned vector
index artifact (app/runtime/vector_index.py), published as `<registry>/<model>/index/<version>`.

The embeddings stream from the prediction parts `index.batch_rows` at a time into faiss (exact
inner product by default, HNSW or IVF when `index.method` says so), and the items' ids and
metadata to a Parquet file beside it: only the faiss index is ever whole in memory. For an approximate index the report holds its recall@10 against exact
search on held-out queries (corpus vectors with noise added, so none is an item itself), the
exact answers found by a second streamed pass. Build time and peak memory are in the report.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from app import storage
from app.config import Config, IndexConfig
from app.errors import UserError
from app.export.publish import publish
from app.predict.write import verify_output
from app.runtime import artifact as art
from app.runtime.vector_index import (
    INDEX_FILE,
    INDEX_TASK,
    ITEMS_FILE,
    THUMBNAIL,
    THUMBNAILS_FILE,
    THUMBNAILS_SCHEMA,
    set_search_params,
)

log = logging.getLogger(__name__)
EMBEDDING = "embedding"
# Thumbnails are stored apart (THUMBNAILS_FILE), never as metadata.
NOT_METADATA = (EMBEDDING, THUMBNAIL, "model_name", "model_version")
ITEM_ID = "id"  # the items table's first column: each item's id (predict's id column)
TOP = 10


def build_index(config: Config, embeddings: str) -> dict[str, Any]:
    predicted = verify_output(embeddings)  # every part's sha256, and what model embedded them
    parts = [storage.join(embeddings, s.file) for s in predicted.files]
    if not parts:
        raise UserError(f"{embeddings}: no embeddings to index")
    columns = check_embeddings(embeddings, predicted.model_name, parts[0])
    thumbnails = config.index.thumbnails and THUMBNAIL in columns
    if config.index.thumbnails and not thumbnails:
        log.warning(
            "index: %s holds no thumbnails (captions, or pictures embedded without "
            "index.thumbnails=true): the index stores none",
            embeddings,
        )
    with tempfile.TemporaryDirectory() as work:
        return build_in(config, predicted, parts, work, thumbnails)


def build_in(
    config: Config, predicted: Any, parts: list[str], work: str, thumbnails: bool
) -> dict[str, Any]:
    """The index built in `work` (its items, and thumbnails when kept, streamed to Parquet
    there), then published."""
    cfg = config.index
    started, peak = time.perf_counter(), Peak()
    index, columns = fill(cfg, parts, peak, work, thumbnails)
    build_s = time.perf_counter() - started
    name = cfg.name or f"{predicted.model_name}-index"
    report = {
        "vectors": int(index.ntotal),
        "dim": int(index.d),
        "method": cfg.method,
        "build_seconds": round(build_s, 3),
        "peak_rss_mib": round(peak.mib(), 1),
        "index_bytes": None,
        "recall_at_10": held_out_recall(cfg, index, parts),
    }
    schema = {
        "task": INDEX_TASK,
        "method": cfg.method,
        "metric": "inner_product",
        "embed_dim": int(index.d),
        "metadata_columns": [c for c in columns if c != ITEM_ID],
        "encoder": {
            "uri": storage.resolved(predicted.artifact),
            "name": predicted.model_name,
            "version": predicted.model_version,
        },
        "ef_search": cfg.ef_search,
        "nprobe": cfg.nprobe,
    }
    uri = publish_index(config, name, predicted.model_name, index, work, schema, report)
    log.info(
        "index: %d vectors of %s %s -> %s",
        index.ntotal,
        predicted.model_name,
        predicted.model_version,
        uri,
    )
    return {"stage": "index", "artifact": uri, "name": name, "report": report}


class Peak:
    """The process's peak resident memory so far (the kernel's high-water mark, stdlib only)."""

    def sample(self) -> None:  # the kernel keeps the maximum: nothing to sample
        pass

    def mib(self) -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def batches(parts: list[str], rows: int) -> Iterator[pa.Table]:
    """The prediction parts, `rows` at a time (a part is never read whole)."""
    for part in parts:
        fs, path = storage.filesystem(part)
        with fs.open_input_file(path) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=rows):
                yield pa.Table.from_batches([batch])


def vectors(table: pa.Table) -> np.ndarray:
    column = table[EMBEDDING].combine_chunks()
    flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    return flat.reshape(table.num_rows, -1)


def empty_index(cfg: IndexConfig, dim: int) -> Any:
    import faiss

    if cfg.method == "hnsw":
        index = faiss.IndexHNSWFlat(dim, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = cfg.ef_construction
        return index
    if cfg.method == "ivf":
        quantizer = faiss.IndexFlatIP(dim)
        return faiss.IndexIVFFlat(quantizer, dim, cfg.nlist, faiss.METRIC_INNER_PRODUCT)
    return faiss.IndexFlatIP(dim)


def check_embeddings(uri: str, model: str, first_part: str) -> list[str]:
    """A retrieval model's predictions (their columns), or one line saying what they are
    instead."""
    fs, path = storage.filesystem(first_part)
    with fs.open_input_file(path) as f:
        names = pq.ParquetFile(f).schema_arrow.names
    if EMBEDDING not in names:
        raise UserError(
            f"{uri}: predictions of {model!r} hold no {EMBEDDING!r} column (columns: "
            f"{names[:8]}); jobs.index takes a retrieval model's jobs.predict output"
        )
    return names


def fill(
    cfg: IndexConfig, parts: list[str], peak: Peak, work: str, thumbnails: bool = False
) -> tuple[Any, list[str]]:
    """Every part's vectors added in order; the items' ids and metadata (and thumbnails, when
    asked for) streamed beside them to Parquet files in `work` (never held whole). An IVF index
    is trained first on the first `batch_rows` vectors. Returns the index and the items'
    columns."""
    index, writer, offset = None, None, 0
    pictures = (
        pq.ParquetWriter(os.path.join(work, THUMBNAILS_FILE), THUMBNAILS_SCHEMA)
        if thumbnails
        else None
    )
    try:
        for table in batches(parts, cfg.batch_rows):
            x = vectors(table)
            if index is None:
                index = empty_index(cfg, x.shape[1])
                if not index.is_trained:
                    if len(x) < cfg.nlist:
                        raise UserError(
                            f"index.nlist={cfg.nlist}: the first {len(x)} vectors cannot train "
                            "that many lists; lower index.nlist or raise index.batch_rows"
                        )
                    index.train(x)
            index.add(x)
            items = item_table(table.drop([c for c in NOT_METADATA if c in table.column_names]))
            check_metadata(items, cfg.max_metadata_bytes, offset)
            writer = writer or pq.ParquetWriter(os.path.join(work, ITEMS_FILE), items.schema)
            writer.write_table(items.cast(writer.schema))
            if pictures is not None:
                column = table[THUMBNAIL].cast(pa.binary())
                pictures.write_table(pa.table([column], schema=THUMBNAILS_SCHEMA))
            offset += table.num_rows
            peak.sample()
    finally:
        for open_writer in (writer, pictures):
            if open_writer is not None:
                open_writer.close()
    assert index is not None and writer is not None
    return index, list(writer.schema.names)


def item_table(table: pa.Table) -> pa.Table:
    """Predictions' id and passthrough columns -> the items table: the id column named `id`,
    a passthrough column of that name refused, binary columns stored base64-encoded (what a
    search answer, JSON, can carry)."""
    id_column, *rest = table.column_names
    if ITEM_ID in rest:
        raise UserError(
            f"metadata column {ITEM_ID!r}: the name of each item's id (here from the "
            f"{id_column!r} column); rename that column in the corpus"
        )
    columns = [table[id_column]] + [_json_safe(table[c]) for c in rest]
    return pa.table(columns, names=[ITEM_ID, *rest])


def _json_safe(column: pa.ChunkedArray) -> pa.ChunkedArray:
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        return column
    encoded = [None if v is None else base64.b64encode(v).decode() for v in column.to_pylist()]
    return pa.chunked_array([pa.array(encoded, pa.string())])


def check_metadata(items: pa.Table, limit: int, offset: int) -> None:
    """Every item's metadata within `limit` bytes (as JSON, roughly): a search answer holds
    up to serve.max_search_results of them, so this bounds its size."""
    sizes = np.zeros(items.num_rows, np.int64)
    for name in items.column_names[1:]:
        column = items[name]
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            lengths = pc.fill_null(pc.binary_length(column), 0).to_numpy(zero_copy_only=False)
        else:
            lengths = np.full(items.num_rows, 24)  # a number, a boolean, null: a few bytes
        sizes += len(name) + 6 + lengths
    over = np.flatnonzero(sizes > limit)
    if len(over):
        row = int(over[0])
        item = items[ITEM_ID][row].as_py()
        raise UserError(
            f"item {str(item)[:60]!r} (row {offset + row}): {int(sizes[row])} bytes of metadata, "
            f"more than index.max_metadata_bytes={limit}"
        )


def held_out_recall(cfg: IndexConfig, index: Any, parts: list[str]) -> float | None:
    """The index's recall@10 against exact search (None for an exact index: it is exact)."""
    if cfg.method == "exact":
        return None
    rng = np.random.default_rng(0)
    first = vectors(next(batches(parts, cfg.batch_rows)))
    chosen = first[rng.choice(len(first), size=min(cfg.recall_queries, len(first)), replace=False)]
    queries = chosen + rng.normal(0, 0.05, chosen.shape).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    exact = exact_top(queries, parts, cfg.batch_rows)
    set_search_params(index, cfg.ef_search, cfg.nprobe)
    _, found = index.search(queries, TOP)
    hits = [len(set(a) & set(b)) for a, b in zip(found.tolist(), exact.tolist(), strict=True)]
    return sum(hits) / (TOP * len(queries))


def exact_top(queries: np.ndarray, parts: list[str], rows: int) -> np.ndarray:
    """The exact top-10 item numbers of each query, by a streamed pass over the parts."""
    best_scores = np.full((len(queries), TOP), -np.inf, np.float32)
    best_ids = np.full((len(queries), TOP), -1, np.int64)
    offset = 0
    for table in batches(parts, rows):
        x = vectors(table)
        scores = queries @ x.T
        ids = np.broadcast_to(np.arange(offset, offset + len(x)), scores.shape)
        all_scores = np.concatenate([best_scores, scores], axis=1)
        all_ids = np.concatenate([best_ids, ids], axis=1)
        keep = np.argsort(-all_scores, axis=1, kind="stable")[:, :TOP]
        best_scores = np.take_along_axis(all_scores, keep, 1)
        best_ids = np.take_along_axis(all_ids, keep, 1)
        offset += len(x)
    return best_ids


def publish_index(
    config: Config,
    name: str,
    model: str,
    index: Any,
    work: str,
    schema: dict[str, Any],
    report: dict[str, Any],
) -> str:
    """`work` (the items already there) with the index, schema, report and manifest, published
    as the next version of `<registry>/<model>/index`."""
    import faiss

    raw = faiss.serialize_index(index).tobytes()
    report["index_bytes"] = len(raw)
    files = {
        INDEX_FILE: raw,
        "schema.json": (json.dumps(schema, indent=2) + "\n").encode(),
        "report.json": (json.dumps(report, indent=2, sort_keys=True) + "\n").encode(),
    }
    for file, data in files.items():
        with open(os.path.join(work, file), "wb") as f:
            f.write(data)
    del raw, files
    listed = {
        file: art.ArtifactFile(sha256=storage.sha256(path), size=os.path.getsize(path))
        for file in sorted(os.listdir(work))
        if os.path.isfile(path := os.path.join(work, file))
    }
    art.ArtifactManifest(
        name=name,
        created=datetime.now(UTC).isoformat(),
        workload=config.workload,
        files=listed,
    ).write(os.path.join(work, art.MANIFEST))
    return publish(work, config.registry, f"{model}/index")
