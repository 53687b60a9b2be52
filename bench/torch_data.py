"""The plain-PyTorch baseline of the ingest path: a torch DataLoader over the same Parquet shards,
transformed by the same fitted preprocessor (app.data.preprocess), no Ray.

`TorchShard.batches(batch_size, seed)` is the feed interface of app.data.feed (a seed shuffles, None
keeps the stored order), so the baseline runs app.train.loop.train_epoch and the classifier validation unchanged:
only the data feeding differs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from app import storage
from app.data import kinds
from app.data.ingest import rank_range
from app.data.preprocess import Preprocessor

READ_ROWS = (
    256  # rows per transform call (app.data.ingest.stream_split transforms a shard piece per call)
)

Batch = dict[str, np.ndarray]


def _rows(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def _concat(a: Batch | None, b: Batch) -> Batch:
    return b if a is None else {k: np.concatenate([a[k], b[k]]) for k in b}


def _take(batch: Batch, index: Any) -> Batch:
    return {k: v[index] for k, v in batch.items()}


def _to_torch(batch: Batch) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}


class ShardStream(IterableDataset):
    """Streams shards one record batch at a time: read -> transform -> (rank slice) -> batches.

    - `rank`/`world`: each rank takes an equal contiguous range of rows (the remainder is dropped,
      as the project's own data paths do: app.data.ingest.rank_range) and skips shards outside its range unread.
    - `shuffle_buffer`: a local shuffle buffer like Ray's `local_shuffle_buffer_size`: batches
      are drawn at random from a buffer holding at least that many rows.
    """

    def __init__(
        self,
        files: list[str],
        state_json: str,
        batch_size: int,
        rank: int = 0,
        world: int = 1,
        shuffle_buffer: int | None = None,
        seed: int | None = None,
    ):
        super().__init__()
        self.files, self.state_json, self.batch_size = files, state_json, batch_size
        self.rank, self.world = rank, world
        self.shuffle_buffer, self.seed = shuffle_buffer or 0, seed

    def _chunks(self) -> Iterator[Batch]:
        pre = kinds.from_json(self.state_json)
        files = self.files
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            if self.world > 1:
                raise ValueError("rank splitting and several DataLoader workers do not mix here")
            files = files[info.id :: info.num_workers]
        sizes = [pq.ParquetFile(storage.filesystem(f)[1]).metadata.num_rows for f in files]
        lo, hi = rank_range(sum(sizes), self.rank, self.world)  # as the memory path splits
        offset = 0
        for uri, size in zip(files, sizes, strict=True):
            start, offset = offset, offset + size
            if offset <= lo or start >= hi:
                continue  # none of this shard's rows are ours: never read it
            reader = pq.ParquetFile(storage.filesystem(uri)[1])
            row = start
            for record_batch in reader.iter_batches(batch_size=READ_ROWS):
                first, row = row, row + record_batch.num_rows
                a, b = max(lo, first) - first, min(hi, row) - first
                if b <= a:
                    continue
                part = record_batch.slice(a, b - a).to_pandas()
                yield pre.transform_batch({c: part[c].to_numpy() for c in part.columns})

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        bs = self.batch_size
        rng = np.random.default_rng(self.seed)
        buf: Batch | None = None
        for chunk in self._chunks():
            buf = _concat(buf, chunk)
            if self.shuffle_buffer:
                if _rows(buf) >= self.shuffle_buffer + bs:
                    buf = _take(buf, rng.permutation(_rows(buf)))
                    while _rows(buf) >= self.shuffle_buffer + bs:
                        yield _to_torch(_take(buf, slice(0, bs)))
                        buf = _take(buf, slice(bs, None))
            else:
                while _rows(buf) >= bs:
                    yield _to_torch(_take(buf, slice(0, bs)))
                    buf = _take(buf, slice(bs, None))
        if buf is None or not _rows(buf):
            return
        if self.shuffle_buffer:
            buf = _take(buf, rng.permutation(_rows(buf)))
        for start in range(0, _rows(buf), bs):  # the last batch may be short (drop_last=False)
            yield _to_torch(_take(buf, slice(start, start + bs)))


class TorchShard:
    """A feed (app.data.feed's `batches` interface) backed by a torch DataLoader over the shards."""

    def __init__(
        self,
        files: list[str],
        preprocessor: Preprocessor,
        rank: int = 0,
        world: int = 1,
        num_workers: int = 0,
        shuffle_buffer: int = 0,
    ):
        self.files, self.state_json = files, preprocessor.to_json()
        self.rank, self.world, self.num_workers = rank, world, num_workers
        self.shuffle_buffer = shuffle_buffer

    def loader(
        self, batch_size: int, shuffle_buffer: int | None = None, seed: int | None = None
    ) -> DataLoader:
        stream = ShardStream(
            self.files, self.state_json, batch_size, self.rank, self.world, shuffle_buffer, seed
        )
        return DataLoader(
            stream,
            batch_size=None,  # the stream yields whole batches
            num_workers=self.num_workers,
            prefetch_factor=2 if self.num_workers else None,
            # Fork, as a torchrun-launched script on Linux does: under torch.multiprocessing's
            # spawn the default would start a fresh interpreter for every epoch's loader
            # (2.5 s each, measured), which no plain-PyTorch user would put up with.
            multiprocessing_context="fork" if self.num_workers else None,
        )

    def batches(
        self, batch_size: int, seed: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        shuffle = self.shuffle_buffer if seed is not None else None
        return iter(self.loader(batch_size, shuffle, seed))
