"""`index:`: the vector index built from a retrieval model's embeddings (jobs.index)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from app.config.section import NAME_PATTERN, Section


class IndexConfig(Section):
    """`index`: the vector index `jobs.index` builds from a retrieval model's embeddings."""

    name: str | None = Field(None, pattern=NAME_PATTERN)  # default: <export name>-index
    # exact: inner product over every vector (faiss IndexFlatIP); hnsw: a graph of `hnsw_m`
    # neighbours a node; ivf: `nlist` inverted lists, `nprobe` of them searched a query.
    method: Literal["exact", "hnsw", "ivf"] = "exact"
    hnsw_m: int = Field(32, ge=4, le=256)
    ef_construction: int = Field(80, ge=8)
    ef_search: int = Field(64, ge=1)
    nlist: int = Field(256, ge=1)
    nprobe: int = Field(16, ge=1)
    # Held-out queries whose top-10 from the index is compared with the exact top-10.
    recall_queries: int = Field(200, ge=1)
    batch_rows: int = Field(8192, ge=1)  # embeddings read and added at a time (never all at once)
    # An item's stored metadata (its passthrough columns) at most: a search answer carries up
    # to serve.max_search_results items, so this bounds its size. More is refused, by row.
    max_metadata_bytes: int = Field(4096, ge=64)
    # A JPEG thumbnail per picture (jobs.predict makes it as it embeds, jobs.index stores it)
    # for the search page: longest side `thumbnail_px`; one over `max_thumbnail_bytes` is
    # left out (the page shows the item without it).
    thumbnails: bool = False
    thumbnail_px: int = Field(128, ge=16, le=128)
    max_thumbnail_bytes: int = Field(16384, ge=1024, le=65536)
