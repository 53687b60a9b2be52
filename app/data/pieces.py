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

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from app import storage
from app.data.reasons import Reasons

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
    """A piece's rows, split by key, streamed into shards of at most `rows_per_shard` rows
    named by the piece and their order in it (`<split>/part-<piece>-<n>.parquet`): each batch's
    rows of a split go to that split's open shard as a row group, so a task holds one batch,
    never a shard; a shard is hashed (and uploaded, to an object store) as it closes."""

    def __init__(self, target: Target, piece: int, schema: pa.Schema):
        self.target, self.piece, self.schema = target, piece, schema
        self.open: dict[str, _OpenShard] = {}
        self.written: list[ShardRecord] = []

    def add(self, table: pa.Table, keys: np.ndarray, codes: np.ndarray | None = None) -> None:
        """The rows into their splits' shards: by key, or by `codes` when the source has its
        own split (0 train, 1 val, 2 test)."""
        codes = self.target.rule.codes(keys) if codes is None else codes
        for code, split in enumerate(SPLITS):
            mask = codes == code
            if mask.any():
                self._write(split, table.filter(pa.array(mask)))

    def close(self) -> list[ShardRecord]:
        for split in list(self.open):
            self._finish(split)
        return sorted(self.written, key=lambda r: r.file)

    def _write(self, split: str, rows: pa.Table) -> None:
        rows = rows.cast(self.schema)
        while rows.num_rows:
            shard = self.open.get(split) or self._start(split)
            take = min(rows.num_rows, self.target.rows_per_shard - shard.rows)
            shard.writer.write_table(rows.slice(0, take))
            shard.rows += take
            rows = rows.slice(take)
            if shard.rows >= self.target.rows_per_shard:
                self._finish(split)

    def _start(self, split: str) -> _OpenShard:
        n = sum(1 for r in self.written if r.split == split)
        name = f"{split}/part-{self.piece:06d}-{n:04d}.parquet"
        uri = storage.join(self.target.folder, name)
        if storage.is_local(uri):
            path, scratch = storage.filesystem(uri)[1], None
            os.makedirs(os.path.dirname(path), exist_ok=True)
        else:  # written here, uploaded whole when it closes
            scratch = tempfile.mkdtemp(prefix="shard-")
            path = os.path.join(scratch, "part.parquet")
        # Dictionary pages for text only: for numbers Parquet tries a dictionary in every row
        # group and falls back, which made writing a batch-sized row group 4.6x slower.
        text = [f.name for f in self.schema if pa.types.is_string(f.type)]
        writer = pq.ParquetWriter(path, self.schema, use_dictionary=text)
        shard = _OpenShard(name, uri, path, scratch, writer)
        self.open[split] = shard
        return shard

    def _finish(self, split: str) -> None:
        shard = self.open.pop(split)
        shard.writer.close()
        digest, size = sha256_and_size(shard.path)
        if shard.scratch is not None:
            storage.upload_file(shard.path, shard.uri)
            shutil.rmtree(shard.scratch, ignore_errors=True)
        t = self.target
        file = f"{t.prefix}/{shard.name}" if t.prefix else shard.name
        self.written.append(ShardRecord(split, file, shard.rows, digest, size))


@dataclass
class _OpenShard:
    name: str  # relative to the generation
    uri: str
    path: str  # where it is written (the file itself, on local disk)
    scratch: str | None  # the local folder to remove once it is uploaded
    writer: pq.ParquetWriter
    rows: int = 0


def sha256_and_size(path: str) -> tuple[str, int]:
    return storage.sha256(path), os.path.getsize(path)


# --- what a task returns, and what prepare needs to run a source in pieces -----------------------


@dataclass
class PieceResult:
    """What a task did with its piece: small whatever the piece's size."""

    index: int
    rows: int = 0
    bad: int = 0
    problem: str | None = None  # the piece cannot be read as the source says: always fatal
    first_bad: str | None = None  # "<file> row <n>: why", the piece's lowest bad row
    examples: list[str] = field(default_factory=list)
    reasons: Reasons = field(default_factory=Reasons)  # bad rows by reason
    labels: list[str] = field(default_factory=list)
    shards: list[ShardRecord] = field(default_factory=list)
    peak_rss_mib: float = 0.0  # of the process that ran the piece, when it finished

    def note_bad(self, count: int, problems: dict[int, str], limit: int) -> None:
        """`count` bad rows of one batch, `problems` saying why by row in the source (the
        lowest among them): counted (by reason), the first kept, examples up to `limit`."""
        self.bad += count
        for row in sorted(problems):
            self.reasons.add(problems[row])
        if count > len(problems):  # a source that names fewer rows than it drops
            self.reasons.add("a row of no stated reason", count - len(problems))
        if not problems:
            return
        if self.first_bad is None:
            self.first_bad = problems[min(problems)]
        room = limit - len(self.examples)
        self.examples.extend([problems[r] for r in sorted(problems)][: max(room, 0)])


@dataclass(frozen=True)
class SourcePlan:
    """A source cut into pieces, and what its dataset's manifest says of it. `run(piece,
    target)` is what one task does with one piece (a module-level function or a partial of one,
    so it pickles)."""

    kind: str
    features: tuple[str, ...]
    label: str
    schema: pa.Schema
    pieces: Sequence[Any]
    run: Callable[..., PieceResult]
    description: dict[str, Any]
    skip_bad_rows: bool = False
    own_split: bool = False  # the source says each row's split (Karpathy's JSON)
    scratch: tuple[str, ...] = ()  # files planning wrote for the tasks, removed once they ran
    image_shape: tuple[int, int, int] | None = None
    max_examples: int = 5
    files: dict[str, bytes] = field(default_factory=dict)  # stored beside the shards, by name
    block_size: int | None = None  # tokens: the model input length (rows hold one more)
    # Why a required split came out empty, "{split}" naming it (rows are split by key).
    too_few: str = "only {rows} rows: too few to split into train/val/test"


def split_rows_of(records: Sequence[ShardRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for record in records:
        out[record.split] = out.get(record.split, 0) + record.rows
    return out


def ordered(records: Sequence[ShardRecord]) -> dict[str, list[ShardRecord]]:
    """The shards of every split in source order (piece, then their order in it)."""
    out: dict[str, list[ShardRecord]] = {}
    for record in sorted(records, key=lambda r: r.file):
        out.setdefault(record.split, []).append(record)
    return out
