"""A vector index's replica: search over one index version, its queries encoded by exactly the
encoder version the index was built with (the index names it; the model's own deployment can
move on without changing what search means).

A query is a text, a picture (bytes), a raw embedding (of the index's dimension) or the id of a
stored item; an equality filter on the stored metadata keeps the top_k among matching items
(fewer only when fewer match). Each replica serves one version, so during a redeploy every
answer comes whole from one version.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from ray import serve

from app.config import ServeConfig
from app.runtime.artifact import open_artifact
from app.runtime.types import (
    ModelInfo,
    RequestError,
    SearchQuery,
    SearchRequest,
    SearchResult,
)
from app.runtime.vector_index import VectorIndex, open_index, set_search_params
from app.serve.metrics import RetrievalMetrics
from app.serve.replicas.apps import SelfServing
from app.serve.replicas.base import Replica
from app.serve.replicas.batching import serve_batcher
from app.tasks.retrieval.replica import Encoders, picture_limits

log = logging.getLogger("ray.serve")


class SearchServer(Replica):
    ROUTE = "is an index: POST /v1/models/{name}:search"

    def __init__(self, artifact_uri: str, cfg: ServeConfig):
        super().__init__(artifact_uri, cfg)  # the index, its encoder's variant (`load`)
        self.limits = picture_limits(cfg)
        items = self.vectors.items
        # Each stored field as a Python list: a hit's record is a few list reads (an Arrow
        # `take` per query cost as much as the search), for a few bytes a row more.
        self.fields = {c: items[c].to_pylist() for c in items.column_names}
        self.ids = {str(v): i for i, v in enumerate(self.fields["id"])}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="faiss")
        if hasattr(self.vectors.index, "make_direct_map"):  # IVF: stored vectors by id
            self.vectors.index.make_direct_map()
        set_search_params(
            self.vectors.index, self.vectors.schema["ef_search"], self.vectors.schema["nprobe"]
        )
        self.metrics = RetrievalMetrics(self.vectors.name, str(self.vectors.version))
        self.search_batch = serve_batcher(self._search_batch, cfg)
        self.in_flight = 0  # searches inside this replica: alone, one need not wait for mates

    def open(self, uri: str) -> VectorIndex:
        self.vectors: VectorIndex = open_index(uri)
        self.encoder = open_artifact(self.vectors.encoder["uri"])  # the version it names
        return self.vectors  # what the routes name it by

    def choose(self, variant: str) -> str:
        return self.encoder.choose_variant(variant)  # the encoder's variants

    def load(self, variant: str) -> None:
        self.encoders = Encoders(self.encoder, variant, self.threads)

    def describe(self) -> str:
        v = self.vectors
        return (
            f"index {v.name} ({v.index.ntotal} vectors, encoder {self.encoder.name} version "
            f"{self.encoder.version})"
        )

    async def check_health(self) -> None:
        await self._answer(SearchRequest((SearchQuery(text="health check"),), 1))

    async def info(self) -> ModelInfo:
        v = self.vectors
        manifest = v.manifest.model_dump(mode="json", exclude={"files"})
        return ModelInfo(
            name=v.name,
            version=v.version,
            variant=self.variant,
            artifact=v.uri,
            task=v.schema["task"],
            generates=False,
            inputs=[{"name": "query", "datatype": "BYTES", "shape": [-1]}],
            outputs=[],
            labels=[],
            manifest=manifest | {"encoder": v.encoder, "vectors": int(v.index.ntotal)},
            replica_pid=os.getpid(),
            searches=True,
        )

    async def search(self, request: SearchRequest) -> SearchResult:
        started = time.perf_counter()
        result = await self._answer(request)
        self.metrics.observe(len(request.queries), 1000 * (time.perf_counter() - started))
        return result

    async def thumbnail(self, item: str) -> bytes:
        """An item's stored thumbnail (JPEG), by id."""
        row = self.ids.get(item)
        if row is None:
            raise RequestError(404, f"no item {item[:60]!r} in index {self.vectors.name!r}")
        thumbnails = self.vectors.thumbnails
        data = thumbnails[row].as_py() if thumbnails is not None else None
        if data is None:
            why = "has none" if thumbnails is not None else "was built without index.thumbnails"
            raise RequestError(404, f"no thumbnail for item {item[:60]!r}: the index {why}")
        return data

    async def _answer(self, request: SearchRequest) -> SearchResult:
        """Through the batcher, which waits up to batch_wait_timeout_s for mates; a search alone
        in the replica runs at once (the searches arriving meanwhile fill the next batch)."""
        within_caps(request, self.cfg)
        alone = self.in_flight == 0
        self.in_flight += 1
        try:
            if alone and quick(request):  # a fraction of a millisecond: no thread hop
                [found] = self._search_all([request])
                answer = self._result(found)
            elif alone:
                [answer] = await self._search_batch([request])
            else:
                answer = await self.search_batch(request)
        finally:
            self.in_flight -= 1
        if isinstance(answer, RequestError):
            raise answer
        return answer

    async def _search_batch(self, requests: list[SearchRequest]) -> list[Any]:
        """Requests that arrived together, searched in one faiss call (each its SearchResult or
        its own RequestError)."""
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(self.pool, self._search_all, requests)
        return [self._result(f) for f in found]

    def _result(self, found: Any) -> SearchResult | RequestError:
        if isinstance(found, RequestError):
            return found
        return SearchResult(found, self.vectors.version, self.encoder.version, os.getpid())

    def _search_all(self, requests: list[SearchRequest]) -> list[Any]:
        """Each request's hits (or its RequestError): those without a filter share one
        `index.search` at the largest top_k, each cut to its own (a prefix: the same top k)."""
        out: list[Any] = [None] * len(requests)
        shared: list[tuple[int, np.ndarray]] = []
        for i, request in enumerate(requests):
            try:
                queries = self._query_vectors(request.queries)
                if request.filter:
                    out[i] = self._search(request, queries)
                else:
                    shared.append((i, queries))
            except RequestError as e:
                out[i] = e
        if shared:
            k = max(requests[i].top_k for i, _ in shared)
            scores, found = self._top(np.concatenate([q for _, q in shared]), k, None)
            at = 0
            for i, queries in shared:
                top, n = requests[i].top_k, len(queries)
                rows = zip(scores[at : at + n], found[at : at + n], strict=True)
                out[i] = [self._hits(s[:top], f[:top]) for s, f in rows]
                at += n
        return out

    def _search(self, request: SearchRequest, queries: np.ndarray) -> list[list[dict[str, Any]]]:
        rows = self._matching(request.filter)
        if rows is not None and not len(rows):
            return [[] for _ in request.queries]
        scores, found = self._top(queries, request.top_k, rows)
        return [self._hits(s, f) for s, f in zip(scores, found, strict=True)]

    def _query_vectors(self, queries: tuple[SearchQuery, ...]) -> np.ndarray:
        out = np.zeros((len(queries), self.vectors.dim), np.float32)
        encode: list[tuple[int, str | bytes]] = []
        for i, query in enumerate(queries):
            if query.embedding is not None:
                out[i] = unit_query(query.embedding, self.vectors.dim, i)
            elif query.id is not None:
                out[i] = self._stored(query.id, i)
            else:
                encode.append((i, query.text if query.text is not None else query.image or b""))
        if encode:
            fields = [i for i, _ in encode]
            items = tuple(item for _, item in encode)
            places = [
                f"queries[{i}].{'image' if isinstance(q, bytes) else 'text'}" for i, q in encode
            ]
            embedded, _ = self.encoders.embed(items, "queries", self.limits, places)
            out[fields] = embedded
        return out

    def _stored(self, item: str, i: int) -> np.ndarray:
        row = self.ids.get(str(item))
        if row is None:
            raise RequestError(404, f"queries[{i}].id: no item {str(item)[:60]!r} in the index")
        return self.vectors.index.reconstruct(row)

    def _matching(self, conditions: tuple[tuple[str, Any], ...]) -> np.ndarray | None:
        """Rows whose metadata equals every condition (None: no filter)."""
        if not conditions:
            return None
        items, keep = self.vectors.items, None
        for column, value in conditions:
            if column not in items.column_names:
                known = [c for c in items.column_names if c != "id"]
                raise RequestError(400, f"filter.{column}: not a stored field (stored: {known})")
            if not _fits(value, items[column].type):
                return np.zeros(0, np.int64)  # no stored value of that type equals it
            equal = pc.equal(items[column], pa.scalar(value, items[column].type))
            keep = equal if keep is None else pc.and_(keep, equal)
        assert keep is not None
        return np.flatnonzero(keep.to_numpy(zero_copy_only=False))

    def _top(
        self, queries: np.ndarray, k: int, rows: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The top k of every item, or exactly the top k among `rows` (a filter's matches:
        scored directly, as an approximate index's graph can miss matches a filter isolates)."""
        index = self.vectors.index
        if rows is None:
            return index.search(queries, min(k, index.ntotal))
        k = min(k, len(rows))
        vectors = index.reconstruct_batch(rows.astype(np.int64))
        scores = queries @ vectors.T
        best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(scores, best, 1), rows[best]

    def _hits(self, scores: np.ndarray, found: np.ndarray) -> list[dict[str, Any]]:
        """A query's hits with their stored fields (fewer when fewer match than k: faiss pads
        with -1)."""
        fields = self.fields
        out = []
        for score, row in zip(scores.tolist(), found.tolist(), strict=True):
            if row >= 0:
                metadata = {c: values[row] for c, values in fields.items() if c != "id"}
                out.append({"id": fields["id"][row], "score": float(score), "metadata": metadata})
        return out


def quick(request: SearchRequest) -> bool:
    """Vectors and ids only, no filter: nothing to encode, nothing to scan."""
    return not request.filter and all(q.text is None and q.image is None for q in request.queries)


def unit_query(embedding: np.ndarray, dim: int, i: int) -> np.ndarray:
    """A raw query vector of the index's dimension, scaled to unit length."""
    if len(embedding) != dim:
        raise RequestError(
            400,
            f"queries[{i}].embedding: {len(embedding)} values, the index holds "
            f"{dim}-dimensional vectors",
        )
    # In float64 and scaled by the largest value first: a float32 norm overflowed at 1e20
    # and underflowed to a refusal at 1e-30, and any direction is a fair query.
    vector = np.asarray(embedding, np.float64)
    scale = float(np.abs(vector).max())
    if not math.isfinite(scale) or scale == 0:
        raise RequestError(400, f"queries[{i}].embedding: not a finite, non-zero vector")
    unit = vector / scale
    return (unit / np.linalg.norm(unit)).astype(np.float32)


def within_caps(request: SearchRequest, cfg: ServeConfig) -> None:
    """The route checks these as it reads a body; a replica reached another way (a handle)
    holds to them too."""
    results = len(request.queries) * request.top_k
    for what, value, key, limit in (
        ("top_k", request.top_k, "max_top_k", cfg.max_top_k),
        ("queries", len(request.queries), *cfg.query_limit()),
        ("queries", results, "max_search_results", cfg.max_search_results),
    ):
        if value > limit:
            raise RequestError(413, f"{what}: {value} is over serve.{key}={limit}")


def _fits(value: Any, type_: pa.DataType) -> bool:
    try:
        pa.scalar(value, type_)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        return False
    return True


@serve.ingress()
class SearchApp(SelfServing, SearchServer):
    """A vector index's replica: the same routes, search over one index version."""
