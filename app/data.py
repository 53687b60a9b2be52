"""Ingest: prepared Parquet shards -> Ray Data -> fitted preprocessing -> training workers.

Everything streams: `read_parquet` reads shards lazily, `map_batches` applies the preprocessor's
plain-numpy transform, and workers pull their share with `iter_torch_batches`. The preprocessor is
fitted on the train split one shard at a time on the driver.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from app import storage
from app.config import Config
from app.prepare import read_manifest, split_files
from app.preprocess import Preprocessor


def iter_shards(files: list[str]) -> Iterator[pd.DataFrame]:
    for uri in files:
        fs, path = storage.filesystem(uri)
        yield pq.read_table(path, filesystem=fs).to_pandas()


def fit_preprocessor(config: Config, manifest: dict[str, Any] | None = None) -> Preprocessor:
    output = config.data_output
    manifest = manifest or read_manifest(output)
    files = split_files(output, manifest, "train")
    return Preprocessor.fit(
        iter_shards(files),
        manifest,
        max_length=config.model.max_length,
        vocab_size=config.model.vocab_size,
    )


@functools.lru_cache(maxsize=4)
def _preprocessor(state_json: str) -> Preprocessor:
    # Rebuilt once per Ray Data worker process, not once per batch (the tokenizer parse is costly).
    return Preprocessor.from_json(state_json)


def _transform(batch: dict[str, Any], state_json: str) -> dict[str, Any]:
    return _preprocessor(state_json).transform_batch(batch)


def load_split(
    config: Config, split: str, preprocessor: Preprocessor, manifest: dict[str, Any] | None = None
):
    """A lazy Ray Dataset of model-ready batches for one split (nothing is read until consumed)."""
    import ray.data

    quiet_progress()
    output = config.data_output
    manifest = manifest or read_manifest(output)
    files = split_files(output, manifest, split)
    fs, _ = storage.filesystem(files[0])
    cpus = config.data.task_cpus
    ds = ray.data.read_parquet(
        [storage.filesystem(f)[1] for f in files], filesystem=fs, num_cpus=cpus
    )
    return ds.map_batches(
        _transform,  # type: ignore[arg-type]  # extra kwargs come through fn_kwargs
        fn_kwargs={"state_json": preprocessor.to_json()},
        batch_format="numpy",
        batch_size=256,
        zero_copy_batch=True,
        num_cpus=cpus,
    )


def quiet_progress() -> None:
    """Per-epoch progress bars of Ray Data drown the job log; the train loop logs progress itself."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.enable_operator_progress_bars = False
    ctx.print_on_execution_start = False
