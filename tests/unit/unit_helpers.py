"""Small helpers the unit tests share (files, hashes, staging leftovers)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from app import storage
from app.config import DataConfig
from app.data.prepare import LAYOUT, DatasetManifest, Split

REPO = Path(__file__).resolve().parents[2]
DIGITS_YAML = REPO / "configs" / "digits.yaml"
PYTHON = str(REPO / ".venv" / "bin" / "python")


def sha256_of(path: str | os.PathLike[str]) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def snapshot(folder: str | os.PathLike[str]) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder` (empty when it does not exist)."""
    folder = Path(folder)
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): sha256_of(p) for p in sorted(folder.rglob("*")) if p.is_file()
    }


def staging_leftovers(folder: str | os.PathLike[str]) -> list[str]:
    """Every path under `folder` whose name carries the staging mark."""
    folder = Path(folder)
    if not folder.exists():
        return []
    return sorted(str(p) for p in folder.rglob("*") if storage.STAGING_MARK in p.name)


def read_split(output: str, manifest: DatasetManifest, split: str) -> pd.DataFrame:
    """All rows of one prepared split, shards in manifest order."""
    frames = [
        pq.read_table(os.path.join(output, s.file)).to_pandas()
        for s in manifest.splits[split].shards
    ]
    return pd.concat(frames, ignore_index=True)


def prepared_rows(data: DataConfig, root: str | os.PathLike[str]) -> tuple[pd.DataFrame, dict]:
    """`data` prepared by jobs.prepare's own code, its pieces run in this process: every row
    with its split (a `split` column), in source order within a split, and the summary."""
    from app.data.pieces import InProcess
    from app.data.prepare import read_manifest
    from app.pipeline.stages import prepare
    from tests.conftest import make_config

    config = make_config(root)
    output = str(Path(root) / "data")
    config = config.model_copy(update={"data": data.model_copy(update={"output": output})})
    summary = prepare(config, InProcess())
    manifest = read_manifest(output)
    frames = [read_split(output, manifest, name).assign(split=name) for name in manifest.splits]
    return pd.concat(frames, ignore_index=True), summary


def manifest_with_rows(rows: dict[str, int]) -> DatasetManifest:
    """A dataset manifest with these split sizes and no shards (for code that only counts)."""
    return DatasetManifest(
        layout=LAYOUT,
        created="2024-01-01T00:00:00+00:00",
        source={"source": "test"},
        kind="tabular",
        feature_columns=["f0"],
        label_column="label",
        label_names=["a", "b"],
        columns={"f0": "double", "label": "string"},
        rows=rows,
        splits={name: Split(rows=n, shards=[]) for name, n in rows.items()},
    )


def run_main(capsys, main, argv: list[str]) -> tuple[int, str, str]:
    """A job's `main(argv)` in this process (no subprocess): exit code, stdout, stderr."""
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err
