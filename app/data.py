"""Ingest: prepared Parquet shards -> Ray Data -> fitted preprocessing -> training workers.

The driver decides the data path once per run (`plan_data_path`, logged with its reason):
- `memory`: the preprocessed splits fit the cache budget. Each worker reads its own row range
  of the Parquet shards straight from storage and preprocesses it once (`read_rank_share`: no
  Ray Data execution to plan or start, so the first step comes seconds sooner), keeps it as
  tensors (app/feed.py) and reshuffles it every epoch: no per-epoch set-up at all.
- `stream`: they do not fit. Every epoch streams the shards' row ranges through Ray Data tasks
  that read and preprocess them (`load_split`) into the workers, with several read tasks per
  worker so reading overlaps training, prefetching in the workers,
  and Ray Data's CPUs bounded so it cannot starve the trainers (nor they it).
The preprocessor is fitted on the train split one shard at a time on the driver.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from app import storage
from app.config import Config
from app.prepare import DatasetManifest, read_manifest, split_files
from app.preprocess import Preprocessor

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


def rank_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's contiguous row range of a split: every rank the same count, the last `rows % world`
    rows left out, as Ray Data's `streaming_split(equal=True)` does (DDP and FSDP need every rank
    to run the same number of steps)."""
    share = rows // world
    return rank * share, (rank + 1) * share


def read_rank_share(
    shards: list[tuple[str, int]], rank: int, world: int, pre: Preprocessor
) -> Iterator[dict[str, Any]]:
    """This rank's rows of a split, read straight from its Parquet shards and preprocessed, one
    block per shard file (files outside the rank's range are never opened).

    The in-memory path's worker side: no Ray Data execution, so nothing to plan, schedule or
    start before the first step (`shards` are (uri, rows) in manifest order, already verified
    against their sha256 on the driver).
    """
    lo, hi = rank_range(sum(rows for _, rows in shards), rank, world)
    offset = 0
    for uri, rows in shards:
        start, offset = offset, offset + rows
        a, b = max(lo, start) - start, min(hi, offset) - start
        if b <= a:
            continue
        yield transform_rows(pre, *storage.filesystem(uri), a, b)


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


def shard_pieces(shards: list[tuple[str, int]], pieces: int) -> list[tuple[str, int, int]]:
    """(uri, start, stop) row ranges covering every shard in order, each shard cut into equal
    parts so that there are at least `pieces` in all (one Ray Data task reads each)."""
    cuts_per_shard = max(1, -(-pieces // max(len(shards), 1)))
    out = []
    for uri, rows in shards:
        cuts = max(1, min(cuts_per_shard, rows))
        bounds = [rows * i // cuts for i in range(cuts + 1)]
        out += [(uri, a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return out


def split_shards(config: Config, manifest: DatasetManifest, split: str) -> list[tuple[str, int]]:
    """(uri, rows) of every shard of a split, in manifest order: what `read_rank_share` reads."""
    files = split_files(config.data_output, manifest, split)
    return [(uri, s.rows) for uri, s in zip(files, manifest.splits[split].shards, strict=True)]


def fit_preprocessor(config: Config, manifest: DatasetManifest | None = None) -> Preprocessor:
    output = config.data_output
    manifest = manifest or read_manifest(output)
    if manifest.kind == "tokens":  # tokenized at prepare: adopt the dataset's own tokenizer
        from app.corpus import TOKENIZER_FILE
        from app.prepare import read_dataset_file

        tokenizer = read_dataset_file(output, manifest, TOKENIZER_FILE).decode()
        return Preprocessor.for_tokens(manifest.to_json_dict(), tokenizer)
    files = split_files(output, manifest, "train")
    return Preprocessor.fit(
        iter_shards(files),
        manifest.to_json_dict(),  # Preprocessor.fit takes the manifest's JSON form
        max_length=config.model.max_length,
        vocab_size=config.model.vocab_size,
    )


@functools.lru_cache(maxsize=4)
def _preprocessor(state_json: str) -> Preprocessor:
    # Rebuilt once per Ray Data worker process, not once per batch (the tokenizer parse is costly).
    return Preprocessor.from_json(state_json)


def _read_pieces(
    pieces: dict[str, np.ndarray], state_json: str, fs: pafs.FileSystem
) -> Iterator[dict[str, Any]]:
    pre = _preprocessor(state_json)
    for path, start, stop in zip(pieces["path"], pieces["start"], pieces["stop"], strict=True):
        yield transform_rows(pre, fs, str(path), int(start), int(stop))


def load_split(
    config: Config,
    split: str,
    preprocessor: Preprocessor,
    manifest: DatasetManifest | None = None,
):
    """A lazy Ray Dataset of model-ready blocks for one split, streamed (nothing is read until
    consumed; a split that fits in memory is read by the workers themselves: read_rank_share).

    The input is the manifest's own list of shard row ranges, not `read_parquet`: Ray Data 2.60's
    Parquet source lists the files and reads every footer again on each execution, in a pool of
    actors started for it (two fresh processes, ~2.5 s of CPU, every epoch here), while the
    manifest already holds each shard's path and row count. One task reads and preprocesses one
    range: a piece of a shard when there are fewer shards than
    `num_workers x data.stream_read_tasks_per_worker`, so that small blocks start flowing while the
    rest is read; `num_workers x data.stream_reads_in_flight_per_worker` run at once (each
    running task is a worker process Ray starts at the first epoch).
    """
    import ray.data

    quiet_progress()
    manifest = manifest or read_manifest(config.data_output)
    shards = split_shards(config, manifest, split)
    fs, _ = storage.filesystem(shards[0][0])  # one store for the whole dataset
    paths = [(storage.filesystem(uri)[1], rows) for uri, rows in shards]  # once per shard
    tasks = config.train.num_workers * config.data.stream_read_tasks_per_worker
    in_flight = config.train.num_workers * config.data.stream_reads_in_flight_per_worker
    pieces = [{"path": p, "start": a, "stop": b} for p, a, b in shard_pieces(paths, tasks)]
    return ray.data.from_items(pieces, override_num_blocks=len(pieces)).map_batches(
        _read_pieces,  # type: ignore[arg-type]  # extra kwargs come through fn_kwargs
        fn_kwargs={"state_json": preprocessor.to_json(), "fs": fs},
        batch_format="numpy",
        batch_size=1,
        num_cpus=config.data.task_cpus,
        compute=ray.data.TaskPoolStrategy(size=in_flight),
    )


def ingest_options(config: Config):
    """Ray Data execution options for the streamed training datasets.

    They bound Data's CPUs to what the train workers leave free (at least one task's worth), so
    a fast reader cannot take the trainers' cores and the trainers' reservation cannot leave
    Data with nothing, and its object store use to `data.stream_object_store_mb`, so memory
    stays flat however large the dataset.
    """
    import ray
    from ray.data import ExecutionOptions, ExecutionResources

    limit = config.data.stream_max_cpus
    if limit is None:
        total = ray.cluster_resources().get("CPU", 1.0)
        reserved = config.train.num_workers * config.train.cpus_per_worker
        limit = max(total - reserved, config.data.task_cpus)
    store = config.data.stream_object_store_mb * MIB
    return ExecutionOptions(
        resource_limits=ExecutionResources.for_limits(cpu=limit, object_store_memory=store),
        preserve_order=False,
    )


def quiet_progress() -> None:
    """Per-epoch progress bars of Ray Data drown the job log; the train loop logs progress itself."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.enable_operator_progress_bars = False
    ctx.print_on_execution_start = False
