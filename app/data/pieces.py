"""What preparing in tasks shares, whatever the source: the tasks that run a function over a
source's pieces, the split of a row as a pure function of (seed, its key), and the writer that
cuts one piece's rows into shards.

A piece is a part of the source in its own order (a file, a run of a Parquet file's row groups);
each is read, checked and written by one task, and nothing but small records comes back to the
driver. A row's split depends on its key and the seed alone, and the shards a piece writes on its
rows in source order alone, so the same input gives byte-identical shards however Ray cuts its
blocks, however many machines run the tasks and in whatever order they finish; appending rows
moves no existing row to another split.

No Ray here: `InProcess` runs the same functions in this process (the unit tier, tiny sources);
`app.data.ray_tasks.RayTasks` runs them as Ray Data tasks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from app import storage

T = TypeVar("T")
R = TypeVar("R")
SPLITS = ("train", "val", "test")  # split codes 0, 1, 2


class Tasks(Protocol):
    """Runs `fn` over `items`, one task each; the results in the items' order."""

    def map(self, fn: Callable[[T], R], items: Sequence[T], what: str) -> list[R]: ...


class InProcess:
    """Every piece in this process, one after another."""

    def map(self, fn: Callable[[T], R], items: Sequence[T], what: str) -> list[R]:
        return [fn(item) for item in items]


# --- the split of a row -----------------------------------------------------------------------


def row_keys(table: pa.Table, columns: Sequence[str]) -> np.ndarray:
    """One unsigned 64-bit key per row from the values of `columns` (pandas' stable hash: the
    same in every process and run), so equal rows have equal keys."""
    frame = table.select(list(columns)).to_pandas()
    return pd.util.hash_pandas_object(frame, index=False).to_numpy(np.uint64)


@dataclass(frozen=True)
class SplitRule:
    """A row's split from (seed, its key) alone: val with probability `val`, test with `test`."""

    seed: int
    val: float
    test: float

    def codes(self, keys: np.ndarray) -> np.ndarray:
        return split_codes(keys, self.seed, self.val, self.test)


def split_codes(keys: np.ndarray, seed: int, val: float, test: float) -> np.ndarray:
    """Each key's split (0 train, 1 val, 2 test): a uniform draw from (seed, key) alone."""
    with np.errstate(over="ignore"):
        x = _mix(keys.astype(np.uint64) ^ _mix(np.asarray([seed], np.uint64))[0])
    draw = (x >> np.uint64(11)).astype(np.float64) / float(2**53)
    return np.where(draw < val, 1, np.where(draw < val + test, 2, 0)).astype(np.int8)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


# --- one piece's shards -----------------------------------------------------------------------


@dataclass(frozen=True)
class ShardRecord:
    """What a task wrote: one shard, found by the driver through this record alone."""

    split: str
    file: str  # relative to the dataset root
    rows: int
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Target:
    """Where and how a piece's rows are written: `folder` is the generation (a path or URI),
    `prefix` its name relative to the dataset root."""

    folder: str
    prefix: str
    rows_per_shard: int
    rule: SplitRule


class ShardWriter:
    """A piece's rows, split by key, into shards of at most `rows_per_shard` rows named by the
    piece and their order in it (`<split>/part-<piece>-<n>.parquet`), hashed as written."""

    def __init__(self, target: Target, piece: int, schema: pa.Schema):
        self.target, self.piece, self.schema = target, piece, schema
        self.pending: dict[str, list[pa.Table]] = {s: [] for s in SPLITS}
        self.counts: dict[str, int] = dict.fromkeys(SPLITS, 0)
        self.written: list[ShardRecord] = []

    def add(self, table: pa.Table, keys: np.ndarray) -> None:
        t = self.target
        codes = t.rule.codes(keys)
        for code, split in enumerate(SPLITS):
            rows = np.flatnonzero(codes == code)
            if len(rows):
                self.pending[split].append(table.take(pa.array(rows)))
                self.counts[split] += len(rows)
            while self.counts[split] >= t.rows_per_shard:
                self._flush(split, t.rows_per_shard)

    def close(self) -> list[ShardRecord]:
        for split in SPLITS:
            if self.counts[split]:
                self._flush(split, self.counts[split])
        return self.written

    def _flush(self, split: str, rows: int) -> None:
        table = pa.concat_tables(self.pending[split]).combine_chunks()
        shard, rest = table.slice(0, rows), table.slice(rows)
        self.pending[split] = [rest] if rest.num_rows else []
        self.counts[split] = rest.num_rows
        n = sum(1 for r in self.written if r.split == split)
        name = f"{split}/part-{self.piece:06d}-{n:04d}.parquet"
        uri = storage.join(self.target.folder, name)
        with storage.local_path_for(uri) as path:
            pq.write_table(shard.cast(self.schema), path)
            digest, size = sha256_and_size(path)
        file = f"{self.target.prefix}/{name}" if self.target.prefix else name
        self.written.append(ShardRecord(split, file, shard.num_rows, digest, size))


def sha256_and_size(path: str) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def ordered(records: Sequence[ShardRecord]) -> dict[str, list[ShardRecord]]:
    """The shards of every split in source order (piece, then their order in it)."""
    out: dict[str, list[ShardRecord]] = {}
    for record in sorted(records, key=lambda r: r.file):
        out.setdefault(record.split, []).append(record)
    return out


def split_counts(codes: np.ndarray) -> dict[str, int]:
    counts = np.bincount(codes, minlength=len(SPLITS))
    return {s: int(c) for s, c in zip(SPLITS, counts, strict=True) if c}
