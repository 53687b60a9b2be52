"""Ingest: prepared Parquet shards -> Ray Data -> fitted preprocessing -> training workers.

The driver decides the data path once per run (`plan_data_path`, logged with its reason):
- `memory`: the preprocessed splits fit the cache budget. Each worker reads its own row range
  of the Parquet shards straight from storage and preprocesses it once (`read_rank_share`: no
  Ray Data execution to plan or start, so the first step comes seconds sooner), keeps it as
  tensors (app/data/feed.py) and reshuffles it every epoch: no per-epoch set-up at all.
- `stream`: they do not fit. Every epoch each worker streams its own row range of the shards
  through its own Ray Data execution, tasks that read and preprocess it (`stream_split`), with
  several read tasks per worker so reading overlaps training, prefetching in the worker, and
  Ray Data's CPUs bounded so it cannot starve the trainers (nor they it).
The preprocessor is fitted on the train split one shard at a time on the driver.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from app import storage
from app.config import Config
from app.data import kinds
from app.data.kinds import processor
from app.data.prepare import DatasetManifest, split_files
from app.data.preprocess import FitOptions, Preprocessor, PretrainedLookup
from app.ray_private import data_tasks_running, quiet_data_progress

log = logging.getLogger(__name__)
SPLITS = ("train", "val")


# Share of the object store that the cache may take by default: the rest stays for Ray Data
# blocks in flight, Serve and checkpoints on the same cluster.
DEFAULT_BUDGET_FRACTION = 0.25
MIB = 2**20


@dataclass(frozen=True)
class DataPlan:
    """Which data path a run takes, and why (logged and kept in the train summary).

    `mode` is the training split's path; `val_mode` the validation split's, which stays in
    memory when only the training split is too large (a streamed pass costs seconds to start,
    every epoch, however few rows it holds).
    """

    mode: Literal["memory", "stream"]
    reason: str
    preprocessed_bytes: int
    budget_bytes: int
    val_mode: Literal["memory", "stream"] = "memory"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def split_mode(self, split: str) -> str:
        return self.val_mode if split == "val" else self.mode


def plan_data_path(config: Config, manifest: DatasetManifest, pre: Preprocessor) -> DataPlan:
    """The one place that chooses between the in-memory cache and streaming."""
    rows = sum(manifest.rows.get(split, 0) for split in SPLITS)
    size = rows * pre.row_bytes()
    val_size = manifest.rows.get("val", 0) * pre.row_bytes()
    budget = cache_budget_bytes(config)
    sizes = f"preprocessed train + val {size / MIB:.1f} MiB ({rows} rows), budget {budget / MIB:.1f} MiB"
    choice = config.data.cache
    if choice != "auto":
        return DataPlan(choice, f"data.cache={choice} ({sizes})", size, budget, val_mode=choice)
    if size <= budget:
        return DataPlan("memory", f"fits the cache budget: {sizes}", size, budget)
    if val_size <= budget:
        reason = f"over the cache budget: {sizes}; validation ({val_size / MIB:.1f} MiB) cached"
        return DataPlan("stream", reason, size, budget, val_mode="memory")
    return DataPlan("stream", f"over the cache budget: {sizes}", size, budget, val_mode="stream")


def cache_budget_bytes(config: Config) -> int:
    """`data.cache_budget_mb`, else a safe fraction of the cluster's object store (Ray connected)."""
    if config.data.cache_budget_mb is not None:
        return int(config.data.cache_budget_mb * MIB)
    import ray

    store = ray.cluster_resources().get("object_store_memory", 0.0)
    return int(DEFAULT_BUDGET_FRACTION * store)


def iter_shards(files: list[str]) -> Iterator[pd.DataFrame]:
    for uri in files:
        fs, path = storage.filesystem(uri)
        yield pq.read_table(path, filesystem=fs).to_pandas()


def rank_range(rows: int, rank: int, world: int, every_row: bool = False) -> tuple[int, int]:
    """Rank's contiguous row range of a split. Training: every rank the same count, the last
    `rows % world` rows left out (DDP and FSDP need every rank to run the same number of
    steps). Validation (`every_row`): every row, the ranks' counts differing by at most one
    (`padding_batches` then evens the forward passes)."""
    if every_row:
        return rows * rank // world, rows * (rank + 1) // world
    share = rows // world
    return rank * share, (rank + 1) * share


def rank_ranges(
    shards: list[tuple[str, int]], rank: int, world: int, every_row: bool = False
) -> list[tuple[str, int, int]]:
    """(uri, start, stop) row ranges of the shards that hold rank's share (`rank_range`), in
    manifest order; shards outside it are left out."""
    lo, hi = rank_range(sum(rows for _, rows in shards), rank, world, every_row)
    out, offset = [], 0
    for uri, rows in shards:
        start, offset = offset, offset + rows
        a, b = max(lo, start) - start, min(hi, offset) - start
        if b > a:
            out.append((uri, a, b))
    return out


def read_rank_share(
    shards: list[tuple[str, int]],
    rank: int,
    world: int,
    pre: Preprocessor,
    every_row: bool = False,
) -> Iterator[dict[str, Any]]:
    """This rank's rows of a split, read straight from its Parquet shards and preprocessed, one
    block per shard file (files outside the rank's range are never opened).

    The in-memory path's worker side: no Ray Data execution, so nothing to plan, schedule or
    start before the first step (`shards` are (uri, rows) in manifest order, already verified
    against their sha256 on the driver).
    """
    for uri, a, b in rank_ranges(shards, rank, world, every_row):
        yield transform_rows(pre, *storage.filesystem(uri), a, b)


def padding_batches(rows: int, rank: int, world: int, batch_size: int) -> int:
    """Batches rank must add to its share of a split of `rows` (`rank_range(every_row=True)`)
    so that every rank runs as many forward passes (0 or 1): FSDP gathers each block's
    parameters in forward, and DDP may sync buffers in the first one after training."""
    lo, hi = rank_range(rows, rank, world, every_row=True)
    most = -(-rows // world)
    return -(-most // batch_size) - -(-(hi - lo) // batch_size)


def transform_rows(
    pre: Preprocessor, fs: pafs.FileSystem, path: str, start: int, stop: int
) -> dict[str, Any]:
    """Rows [start, stop) of one Parquet shard, preprocessed; only the row groups that hold them
    are read."""
    shard = pq.ParquetFile(path, filesystem=fs)
    groups, first, offset = [], None, 0
    for g in range(shard.num_row_groups):
        rows = shard.metadata.row_group(g).num_rows
        if offset < stop and offset + rows > start:
            groups.append(g)
            first = offset if first is None else first
        offset += rows
    part = shard.read_row_groups(groups).slice(start - (first or 0), stop - start).to_pandas()
    return pre.transform_batch({c: part[c].to_numpy() for c in part.columns})


def shard_pieces(ranges: list[tuple[str, int, int]], pieces: int) -> list[tuple[str, int, int]]:
    """The (uri, start, stop) row ranges cut into equal parts, in order, so that there are at
    least `pieces` in all (one Ray Data task reads each)."""
    cuts_per_range = max(1, -(-pieces // max(len(ranges), 1)))
    out = []
    for uri, lo, hi in ranges:
        cuts = max(1, min(cuts_per_range, hi - lo))
        bounds = [lo + (hi - lo) * i // cuts for i in range(cuts + 1)]
        out += [(uri, a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return out


def split_shards(config: Config, manifest: DatasetManifest, split: str) -> list[tuple[str, int]]:
    """(uri, rows) of every shard of a split, in manifest order: what `read_rank_share` reads."""
    files = split_files(config.data_output, manifest, split)
    return [(uri, s.rows) for uri, s in zip(files, manifest.splits[split].shards, strict=True)]


def fit_on_train_split(
    config: Config, manifest: DatasetManifest, bases: PretrainedLookup
) -> Preprocessor:
    """A preprocessor of the dataset's kind fitted on its train split, one shard at a time, on
    the driver; with a pretrained folder (`bases`), its tokenizer or image processor adopted."""
    files = split_files(config.data_output, manifest, "train")
    base = bases.base(processor(manifest.kind))
    text_base, image_base = bases.towers(processor(manifest.kind))
    reads = base or text_base
    options = FitOptions(
        max_length=config.model.sequence_length(reads.max_positions if reads else None),
        vocab_size=config.model.vocab_size,
        base=base,
        text_base=text_base,
        image_base=image_base,
        image_size=config.data.image_size,
    )
    return kinds.fit(iter_shards(files), manifest.to_json_dict(), options)


@functools.lru_cache(maxsize=4)
def _preprocessor(state_json: str) -> Preprocessor:
    # Rebuilt once per Ray Data worker process, not once per batch (the tokenizer parse is costly).
    return kinds.from_json(state_json)


def _read_pieces(
    pieces: dict[str, np.ndarray], state_json: str, fs: pafs.FileSystem
) -> Iterator[dict[str, Any]]:
    pre = _preprocessor(state_json)
    for path, start, stop in zip(pieces["path"], pieces["start"], pieces["stop"], strict=True):
        yield transform_rows(pre, fs, str(path), int(start), int(stop))


def stream_split(
    config: Config,
    shards: list[tuple[str, int]],
    preprocessor: Preprocessor,
    rank: int = 0,
    world: int = 1,
    every_row: bool = False,
):
    """A lazy Ray Dataset of rank's share of a split (`rank_range`), model-ready blocks streamed
    as they are read: each train worker streams its own share (a split that fits in memory is
    read by the workers without Ray Data: read_rank_share).

    Each worker runs its own execution, in its own process, rather than one execution split
    across the workers (`streaming_split`): that needs a DatasetManager and a split coordinator,
    two more actor processes started just as training starts, and every batch then passes
    through the coordinator. The input is the manifest's shard row
    ranges, not `read_parquet`: Ray Data 2.60's Parquet source lists the files and reads every
    footer again on each execution, in a pool of actors started for it, while the manifest
    already holds each shard's path and row count. One task reads and preprocesses one range,
    the share cut into `data.stream.read_tasks_per_worker` pieces so that small blocks start
    flowing while the rest is read; `data.stream.reads_in_flight_per_worker` run at once (each
    running task is a worker process Ray starts at the first epoch and keeps while it is busy).
    """
    import ray.data

    quiet_progress()
    d = config.data
    fs, _ = storage.filesystem(shards[0][0])  # one store for the whole dataset
    ranges = [
        (storage.filesystem(u)[1], a, b) for u, a, b in rank_ranges(shards, rank, world, every_row)
    ]
    pieces = [
        {"path": p, "start": a, "stop": b}
        for p, a, b in shard_pieces(ranges, d.stream.read_tasks_per_worker)
    ]
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options = ingest_options(config, world)
    if PacedScheduling not in ctx.custom_execution_callback_classes:
        # Duck-typed: Ray Data only calls the callback's four methods.
        ctx.custom_execution_callback_classes.append(PacedScheduling)  # type: ignore[arg-type]
    return ray.data.from_items(pieces, override_num_blocks=len(pieces)).map_batches(
        _read_pieces,  # type: ignore[arg-type]  # extra kwargs come through fn_kwargs
        fn_kwargs={"state_json": preprocessor.to_json(), "fs": fs},
        batch_format="numpy",
        batch_size=1,
        num_cpus=d.task_cpus,
        compute=ray.data.TaskPoolStrategy(size=d.stream.reads_in_flight_per_worker),
    )


class PacedScheduling:
    """Keeps Ray Data's scheduling loop from spinning in the train worker's process.

    Ray Data 2.60's loop blocks in `ray.wait` only while read tasks run; once they are done, or
    held back because the worker has not taken the blocks already read, it loops without pause,
    a thread that holds the GIL busy beside the training thread. A loop step that comes within 5 ms of the previous one with no task
    running pauses, 1 ms at first and twice as long at each such step in a row, up to 50 ms: a
    consumer that takes blocks fast frees the loop within a few milliseconds, one that
    trains between batches leaves it asleep nearly all the time.
    """

    MIN_STEP_S, FIRST_PAUSE_S, MAX_PAUSE_S = 0.005, 0.001, 0.05

    def __init__(self) -> None:
        self._last = 0.0
        self._pause = self.FIRST_PAUSE_S

    def before_execution_starts(self, executor: Any) -> None: ...

    def on_execution_step(self, executor: Any) -> None:
        now = time.monotonic()
        # While a read task runs, the loop's next step blocks in ray.wait: no pause needed.
        if now - self._last < self.MIN_STEP_S and not data_tasks_running(executor):
            time.sleep(self._pause)
            self._pause = min(2 * self._pause, self.MAX_PAUSE_S)
            now = time.monotonic()
        else:
            self._pause = self.FIRST_PAUSE_S
        self._last = now

    def after_execution_succeeds(self, executor: Any) -> None: ...

    def after_execution_fails(self, executor: Any, error: Exception) -> None: ...


def ingest_options(config: Config, workers: int | None = None):
    """Ray Data execution options for one train worker's stream.

    They bound Data's CPUs to this worker's part of what the train workers leave free (at least
    one task's worth), so a fast reader cannot take the trainers' cores and the trainers'
    reservation cannot leave Data with nothing, and its object store use to its part of
    `data.stream.object_store_mb`, so memory stays flat however large the dataset.
    """
    import ray
    from ray.data import ExecutionOptions, ExecutionResources

    workers = workers or config.train.max_workers  # the group's size now (elastic: it varies)
    limit = config.data.stream.max_cpus
    if limit is None:
        total = ray.cluster_resources().get("CPU", 1.0)
        limit = total - workers * config.train.cpus_per_worker
    cpu = max(limit / workers, config.data.task_cpus)
    store = config.data.stream.object_store_mb * MIB / workers
    return ExecutionOptions(
        resource_limits=ExecutionResources.for_limits(cpu=cpu, object_store_memory=store),
        # A pipeline's stages each stream their row's share: the same order gives each the
        # same batches (the first stage's inputs and the last one's targets).
        preserve_order=config.train.strategy == "pipeline",
    )


def quiet_progress() -> None:
    """Ray Data's per-execution output drowns the job log (each rank streams its own execution
    every epoch); the train loop logs progress itself. Data's warnings still come through."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.enable_operator_progress_bars = False
    ctx.print_on_execution_start = False
    quiet_data_progress()
