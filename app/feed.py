"""Worker-side batch feeds: what a training worker iterates, epoch after epoch.

- `MemoryFeed` keeps the worker's whole shard as tensors after one pass over it and
  reshuffles it every epoch with a seeded generator: after the first epoch there is nothing to
  set up, read or preprocess, so the training loop never waits for data. A seed's order is the
  same whether the shard was just read or not, so a run resumed at epoch e trains epoch e on
  exactly the batches the uninterrupted run did.
- `StreamFeed` iterates a Ray Data shard anew every epoch (local shuffle buffer, prefetching),
  starting each next pass while the current epoch validates and reports.

Both yield dicts of CPU tensors. Nothing here imports Ray: a shard is any object with Ray Data's
`DataIterator` methods, and plain PyTorch (the benchmarks' DDP baseline) uses `MemoryFeed` too.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

Batch = dict[str, torch.Tensor]
# Batch rows while a `tensors` access fills the cache in one pass (no training on it).
FILL_BATCH_ROWS = 1024


class MemoryFeed:
    """A shard held in memory; the first `batches()` call fills it from `source`."""

    def __init__(self, source: Callable[[], Iterable[dict[str, np.ndarray]]]):
        self._source = source
        self._tensors: Batch | None = None

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> MemoryFeed:
        return cls(lambda: [arrays])

    @property
    def tensors(self) -> Batch:
        if self._tensors is None:
            for _ in self._first_pass(FILL_BATCH_ROWS):
                pass
        assert self._tensors is not None
        return self._tensors

    def prefetch(self, batch_size: int, seed: int | None = None) -> None:
        """Nothing to start ahead: the next pass is an index permutation."""

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values()), ()))

    def batches(self, batch_size: int, seed: int | None = None) -> Iterator[Batch]:
        """Batches in a fresh seeded order per `seed` (shuffled), or in stored order (None).

        A shuffled pass permutes the whole shard, so its first call reads the source whole
        first (a first pass shuffling each block as it arrived would order epoch e differently
        in a restarted process than in the run it resumes). An unshuffled first call
        (validation) yields the source's blocks as they arrive while it keeps them.
        """
        if self._tensors is None and seed is None:
            return self._first_pass(batch_size)
        return self._cached_pass(batch_size, seed)

    def _first_pass(self, batch_size: int) -> Iterator[Batch]:
        """Yields the source's rows in stored order while it keeps them. Rows left over at a
        block's end go into the next block's first batch: every batch but the last is full, so
        ranks holding as many rows take as many steps whatever their block sizes (under FSDP
        every validation forward is a collective too)."""
        parts: dict[str, list[torch.Tensor]] = {}
        carry: Batch = {}
        for raw in self._source():
            block = {k: torch.from_numpy(np.asarray(v)) for k, v in raw.items()}
            for key, value in block.items():
                parts.setdefault(key, []).append(value)
            if carry:
                block = {k: torch.cat([carry[k], v]) for k, v in block.items()}
            rows = len(next(iter(block.values())))
            full = rows - rows % batch_size
            for start in range(0, full, batch_size):
                yield {k: v[start : start + batch_size] for k, v in block.items()}
            carry = {k: v[full:] for k, v in block.items()} if full < rows else {}
        if carry:
            yield carry
        self._tensors = {k: torch.cat(v) for k, v in parts.items()}

    def _cached_pass(self, batch_size: int, seed: int | None) -> Iterator[Batch]:
        tensors, rows = self.tensors, len(self)
        order = None
        if seed is not None:
            order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        for start in range(0, rows, batch_size):
            if order is None:  # views, no copy
                yield {k: v[start : start + batch_size] for k, v in tensors.items()}
            else:
                index = order[start : start + batch_size]
                yield {k: v[index] for k, v in tensors.items()}


class StreamFeed:
    """A Ray Data dataset (this worker's share) streamed every epoch.

    Starting a pass costs Ray Data a new streaming execution (planning, read and map tasks):
    up to a second before the first batch. `prefetch` starts the next
    pass in the background as soon as a training epoch ends, so that cost overlaps validation
    and reporting instead of the next epoch's training loop.
    """

    def __init__(self, shard: Any, prefetch_batches: int, shuffle_buffer: int):
        self.shard, self.prefetch_batches, self.shuffle_buffer = (
            shard,
            prefetch_batches,
            shuffle_buffer,
        )
        self._pending: tuple[tuple[int, int | None], Future[Iterator[Batch]]] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def batches(self, batch_size: int, seed: int | None = None) -> Iterator[Batch]:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == (batch_size, seed):
            return pending[1].result()
        return self._open(batch_size, seed)

    def prefetch(self, batch_size: int, seed: int | None = None) -> None:
        """Begin the pass that `batches(batch_size, seed)` will return, up to its first batch."""
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="stream-prefetch")
        future = self._pool.submit(self._started, batch_size, seed)
        self._pending = ((batch_size, seed), future)

    def _started(self, batch_size: int, seed: int | None) -> Iterator[Batch]:
        batches = iter(self._open(batch_size, seed))
        first = next(batches, None)
        return batches if first is None else itertools.chain([first], batches)

    def _open(self, batch_size: int, seed: int | None) -> Iterator[Batch]:
        shuffle = seed is not None and self.shuffle_buffer > 0
        return self.shard.iter_torch_batches(
            batch_size=batch_size,
            prefetch_batches=self.prefetch_batches,
            local_shuffle_buffer_size=self.shuffle_buffer if shuffle else None,
            local_shuffle_seed=seed if shuffle else None,
        )
