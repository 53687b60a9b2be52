"""Reading the input: a file or a folder of Parquet, CSV or JSON Lines, checked for the model's
columns before any work, read lazily by Ray Data (JSON Lines as raw lines)."""

from __future__ import annotations

import csv
import io
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from app import storage
from app.errors import UserError
from app.predict.rows import InputSpec, missing_columns

log = logging.getLogger(__name__)


FORMATS: dict[str, Literal["parquet", "csv", "jsonl"]] = {
    ".parquet": "parquet",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
}


def input_files(uri: str) -> tuple[Literal["parquet", "csv", "jsonl"], list[str]]:
    """A file, or a folder of files of one format (by extension; hidden and `_` files skipped)."""
    uri = uri.rstrip("/")
    if storage.is_file(uri):
        files = [uri]
    elif storage.exists(uri):
        names = [n for n in storage.list_dir(uri) if not n.startswith((".", "_"))]
        files = [storage.join(uri, n) for n in names if _format_of(n)]
        if not files:
            raise UserError(f"{uri}: no {'/'.join(sorted(set(FORMATS.values())))} files")
    else:
        raise UserError(f"{uri}: no such file or folder")
    formats = {_format_of(f) for f in files}
    if None in formats:
        raise UserError(f"{uri}: unknown format; expected one of {', '.join(sorted(FORMATS))}")
    if len(formats) > 1:
        raise UserError(f"{uri}: mixes formats {sorted(formats)}; use one per input")  # type: ignore[type-var]
    return formats.pop(), files  # type: ignore[return-value]


def _format_of(name: str) -> Literal["parquet", "csv", "jsonl"] | None:
    return FORMATS.get(os.path.splitext(name)[1].lower())


def check_columns(files: list[str], spec: InputSpec) -> int | None:
    """Refuse a file that lacks a column the model reads, naming both, before any work. Returns
    the input's row count where the format records it (Parquet), for the summary's check."""
    if spec.format == "jsonl":
        return None  # no header: a line without a key is a bad row
    rows = 0
    for uri in files:
        present, count = _header(uri, spec.format)
        missing = missing_columns(present, spec)
        if missing:
            what = (
                "--id-column" if missing[0] == spec.id_column else "a feature column of the model"
            )
            raise UserError(f"{uri}: no column {missing[0]!r} ({what}); it has {_listed(present)}")
        rows += count or 0
    return rows if spec.format == "parquet" else None


def header(files: list[str], fmt: str) -> list[str]:
    """The first file's column names (JSON Lines has none)."""
    return [] if fmt == "jsonl" else _header(files[0], fmt)[0]


def _header(uri: str, fmt: str) -> tuple[list[str], int | None]:
    fs, path = storage.filesystem(uri)
    if fmt == "parquet":
        meta = pq.read_metadata(path, filesystem=fs)
        return meta.schema.to_arrow_schema().names, meta.num_rows
    with fs.open_input_stream(path) as f:
        head = f.read(1 << 16).decode("utf-8", errors="replace").splitlines()
    return (next(csv.reader(io.StringIO(head[0]))) if head else []), None


def _listed(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"{shown}, ... ({len(names)} columns)" if len(names) > limit else shown or "no columns"


def read_input(files: list[str], spec: InputSpec, cpus: float):
    """A lazy Ray Dataset of the input's id and feature columns (one line per row for JSONL)."""
    import ray.data

    fs, _ = storage.filesystem(files[0])
    paths = [storage.filesystem(f)[1] for f in files]
    if spec.format == "parquet":
        return ray.data.read_parquet(paths, filesystem=fs, columns=spec.columns, num_cpus=cpus)
    if spec.format == "csv":
        from pyarrow import csv as pacsv

        # Features read as raw bytes, so that a value that is not a number (or not UTF-8) is
        # that row's problem, found by the checks, instead of failing the whole file's read.
        convert = pacsv.ConvertOptions(
            column_types={c: pa.binary() for c in spec.feature_columns},
            include_columns=spec.columns,
            include_missing_columns=True,
        )
        return ray.data.read_csv(paths, filesystem=fs, convert_options=convert, num_cpus=cpus)
    return ray.data.read_datasource(JsonLinesSource(paths, filesystem=fs), num_cpus=cpus)


def _json_lines_source():
    from ray.data.datasource import FileBasedDatasource

    class _JsonLinesSource(FileBasedDatasource):
        """JSON Lines as raw lines (bytes, line number, file): parsing happens per row in the
        predictor, because pyarrow's JSON reader fails a whole file on one bad line or type."""

        _FILE_EXTENSIONS = ["jsonl", "ndjson"]

        def _read_stream(self, f, path: str) -> Iterator[pa.Table]:
            lines, numbers = [], []
            for number, line in enumerate(f.readall().split(b"\n"), start=1):
                if line.strip():  # a blank line is no row
                    lines.append(line)
                    numbers.append(number)
                if len(lines) >= 10_000:
                    yield _lines_block(lines, numbers, path)
                    lines, numbers = [], []
            if lines:
                yield _lines_block(lines, numbers, path)

    return _JsonLinesSource


def JsonLinesSource(paths: list[str], **kwargs: Any):  # noqa: N802 - a class, built lazily
    """Ray is imported only when a job reads (nothing heavy at import time)."""
    return _json_lines_source()(paths, **kwargs)


def _lines_block(lines: list[bytes], numbers: list[int], path: str) -> pa.Table:
    return pa.table(
        {
            "line": pa.array(lines, pa.binary()),
            "line_number": pa.array(numbers, pa.int64()),
            "path": pa.array([path] * len(lines), pa.string()),
        }
    )
