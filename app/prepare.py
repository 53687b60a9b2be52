"""Prepare: a raw source -> train/val(/test) Parquet shards + manifest.json, written atomically."""

from __future__ import annotations

import hashlib
import logging
import os
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from app import storage
from app.cli import UserError
from app.config import Config
from app.sources import IMAGE_COLUMN, SourceData, load_source

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def prepare(config: Config) -> dict[str, Any]:
    cfg = config.data
    data = load_source(cfg)
    splits = split_rows(len(data.frame), cfg.val_fraction, cfg.test_fraction, cfg.seed)
    output = config.data_output
    log.info("prepare: %d rows from %s -> %s", len(data.frame), cfg.source, output)
    with storage.staged_dir(output) as staging:
        split_entries = {
            name: write_split(data, idx, os.path.join(staging, name), name, cfg.rows_per_shard)
            for name, idx in splits.items()
        }
        manifest = build_manifest(data, split_entries)
        # The manifest goes last: a folder without one is never taken for a dataset.
        storage.write_json(os.path.join(staging, MANIFEST), manifest)
    rows = {name: entry["rows"] for name, entry in split_entries.items()}
    log.info("prepare: wrote %s", rows)
    return {"stage": "prepare", "output": output, "rows": rows}


def split_rows(
    n: int, val_fraction: float, test_fraction: float, seed: int
) -> dict[str, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(1, round(n * val_fraction))
    n_test = round(n * test_fraction)
    if n - n_val - n_test < 1:
        raise UserError(f"only {n} rows: too few to split into train/val/test")
    splits = {"train": order[n_val + n_test :], "val": order[:n_val]}
    if n_test:
        splits["test"] = order[n_val : n_val + n_test]
    return {k: np.sort(v) for k, v in splits.items()}


def to_arrow(frame: pd.DataFrame, data: SourceData) -> pa.Table:
    columns: dict[str, pa.Array] = {}
    for col in [*data.feature_columns, data.label_column]:
        values = frame[col]
        if col == IMAGE_COLUMN and data.kind == "image":
            flat = np.stack(values.to_list()).astype(np.float32)
            columns[col] = pa.FixedSizeListArray.from_arrays(
                pa.array(flat.reshape(-1)), flat.shape[1]
            )
        else:
            columns[col] = pa.array(
                values.to_numpy() if values.dtype != object else values.to_list()
            )
    return pa.table(columns)


def write_split(
    data: SourceData, idx: np.ndarray, folder: str, name: str, rows_per_shard: int
) -> dict[str, Any]:
    os.makedirs(folder, exist_ok=True)
    shards = []
    for i, start in enumerate(range(0, len(idx), rows_per_shard)):
        part = data.frame.iloc[idx[start : start + rows_per_shard]]
        filename = f"part-{i:05d}.parquet"
        path = os.path.join(folder, filename)
        pq.write_table(to_arrow(part, data), path)
        shards.append(
            {"file": f"{name}/{filename}", "rows": len(part), "sha256": sha256_file(path)}
        )
    return {"rows": int(len(idx)), "shards": shards}


def build_manifest(data: SourceData, splits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    sample = to_arrow(data.frame.iloc[:1], data)
    return {
        "created": datetime.now(timezone.utc).isoformat(),
        "source": data.description,
        "kind": data.kind,
        "feature_columns": data.feature_columns,
        "label_column": data.label_column,
        "label_names": sorted(data.frame[data.label_column].astype(str).unique().tolist()),
        "image_shape": list(data.image_shape) if data.image_shape else None,
        "schema": {f.name: str(f.type) for f in sample.schema},
        "rows": {name: s["rows"] for name, s in splits.items()},
        "splits": splits,
    }


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(output: str) -> dict[str, Any]:
    uri = storage.join(output, MANIFEST)
    if not storage.exists(uri):
        raise UserError(
            f"{output}: no prepared dataset (manifest.json missing); run jobs.prepare first"
        )
    return storage.read_json(uri)


def split_files(output: str, manifest: dict[str, Any], split: str) -> list[str]:
    if split not in manifest["splits"]:
        raise UserError(f"{output}: the prepared dataset has no {split!r} split")
    return [storage.join(output, s["file"]) for s in manifest["splits"][split]["shards"]]
