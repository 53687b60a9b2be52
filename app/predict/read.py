"""Reading the input: a file or a folder of Parquet, CSV or JSON Lines (or of pictures), checked
for the model's columns before any work, cut into pieces on the driver from metadata alone, and
each piece read batch by batch by the actor that scores it (JSON Lines as raw lines)."""

from __future__ import annotations

import csv
import io
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from app import storage
from app.data.pictures import PICTURE_EXTENSIONS
from app.errors import UserError
from app.predict.row_checks import Format, InputSpec, missing_columns

log = logging.getLogger(__name__)


FORMATS: dict[str, Format] = {
    ".parquet": "parquet",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
}


def input_files(uri: str) -> tuple[Format, list[str]]:
    """A file, a folder of files of one format (by extension; hidden and `_` files skipped),
    or a folder of pictures (PNG/JPEG, in its subfolders too): ("pictures", [the folder])."""
    uri = uri.rstrip("/")
    if storage.is_file(uri):
        files = [uri]
    elif storage.exists(uri):
        names = [n for n in storage.list_dir(uri) if not n.startswith((".", "_"))]
        files = [storage.join(uri, n) for n in names if _format_of(n)]
        if not files and picture_names(uri):
            return "pictures", [uri]
        if not files:
            kinds = "/".join(sorted(set(FORMATS.values())))
            raise UserError(f"{uri}: no {kinds} files, and no PNG or JPEG pictures")
    else:
        raise UserError(f"{uri}: no such file or folder")
    formats = {_format_of(f) for f in files}
    if None in formats:
        raise UserError(f"{uri}: unknown format; expected one of {', '.join(sorted(FORMATS))}")
    if len(formats) > 1:
        raise UserError(f"{uri}: mixes formats {sorted(formats)}; use one per input")  # type: ignore[type-var]
    return formats.pop(), files  # type: ignore[return-value]


def picture_names(folder: str) -> list[str]:
    """The pictures under `folder` (its subfolders too), by relative path, sorted; hidden
    files and folders left out."""
    names = [name for name, _, _ in storage.list_files(folder)]
    return [
        n
        for n in names
        if n.lower().endswith(PICTURE_EXTENSIONS)
        and not any(part.startswith(".") for part in n.split("/"))
    ]


def _format_of(name: str) -> Format | None:
    return FORMATS.get(os.path.splitext(name)[1].lower())


def check_columns(files: list[str], spec: InputSpec) -> int | None:
    """Refuse a file that lacks a column the model reads, naming both, before any work. Returns
    the input's row count where the format records it (Parquet), for the summary's check."""
    if spec.format in ("jsonl", "pictures"):
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
    """The first file's column names (JSON Lines and pictures have none)."""
    return [] if fmt in ("jsonl", "pictures") else _header(files[0], fmt)[0]


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


PIECE_ROWS = 100_000  # Parquet rows in one piece (whole row groups): pieces balance the actors
PIECE_PICTURES = 1_000  # pictures one piece names


def pieces_of(files: list[str], spec: InputSpec) -> list[dict[str, Any]]:
    """The input cut into pieces the driver knows from metadata alone (a Parquet file's runs
    of row groups, a CSV or JSON Lines file, a run of pictures), numbered in input order."""
    fs, _ = storage.filesystem(files[0])
    if spec.format == "pictures":
        pieces = picture_pieces(files[0])
    else:
        pieces = input_pieces([storage.filesystem(f)[1] for f in files], spec.format, fs)
    return [{**piece, "index": i} for i, piece in enumerate(pieces)]


def input_pieces(paths: list[str], fmt: str, fs: Any) -> list[dict[str, Any]]:
    """(path, first row group, row groups) per piece: a Parquet file in runs of whole row
    groups of about PIECE_ROWS rows, another format a file each (-1: the whole file)."""
    if fmt != "parquet":
        return [{"path": p, "start": 0, "stop": -1} for p in paths]
    pieces = []
    for path in paths:
        meta = pq.read_metadata(path, filesystem=fs)
        start = rows = 0
        for g in range(meta.num_row_groups):
            rows += meta.row_group(g).num_rows
            if rows >= PIECE_ROWS or g == meta.num_row_groups - 1:
                pieces.append({"path": path, "start": start, "stop": g + 1})
                start, rows = g + 1, 0
        if meta.num_row_groups == 0:
            pieces.append({"path": path, "start": 0, "stop": 0})
    return pieces


def picture_pieces(folder: str) -> list[dict[str, Any]]:
    """Runs of PIECE_PICTURES of a folder's pictures (relative paths, in order)."""
    names = picture_names(folder)
    return [
        {"path": folder, "start": i, "stop": i + len(chunk), "names": chunk}
        for i in range(0, len(names), PIECE_PICTURES)
        if (chunk := names[i : i + PIECE_PICTURES])
    ]


def read_piece(piece: dict[str, Any], spec: InputSpec, fs: Any, rows: int) -> Iterator[pa.Table]:
    """One piece's rows, at most `rows` at a time: the spec's columns (Parquet, CSV), raw
    lines (JSON Lines), or the pictures' relative paths as both id and picture (read where
    they are embedded)."""
    for table in _piece_tables(piece, spec, fs, rows):
        for start in range(0, table.num_rows, rows):
            yield table.slice(start, rows)


def _piece_tables(piece: dict[str, Any], spec: InputSpec, fs: Any, rows: int) -> Iterator[pa.Table]:
    path, start, stop = piece["path"], piece["start"], piece["stop"]
    if spec.format == "pictures":
        names = pa.array(piece["names"], pa.string())
        yield pa.table({spec.id_column: names, spec.feature_columns[0]: names})
    elif spec.format == "parquet":
        shard = pq.ParquetFile(path, filesystem=fs)
        names = set(shard.schema_arrow.names)
        columns = [c for c in spec.columns if c in names]
        groups = list(range(start, stop))
        for batch in shard.iter_batches(rows, row_groups=groups, columns=columns):
            yield pa.Table.from_batches([batch])
    elif spec.format == "csv":
        yield from _csv_batches(path, spec, fs)
    else:
        yield from _json_line_blocks(path, fs)


def _csv_batches(path: str, spec: InputSpec, fs: Any) -> Iterator[pa.Table]:
    from pyarrow import csv as pacsv

    # Features read as raw bytes, so that a value that is not a number (or not UTF-8) is
    # that row's problem, found by the checks, instead of failing the whole file's read.
    convert = pacsv.ConvertOptions(
        column_types={c: pa.binary() for c in spec.feature_columns},
        include_columns=spec.columns,
        include_missing_columns=True,
    )
    with fs.open_input_stream(path) as f, pacsv.open_csv(f, convert_options=convert) as reader:
        for batch in reader:
            yield pa.Table.from_batches([batch])


def _json_line_blocks(path: str, fs: Any, block_lines: int = 10_000) -> Iterator[pa.Table]:
    """JSON Lines as raw lines (bytes, line number, file): parsing happens per row in the
    predictor, because pyarrow's JSON reader fails a whole file on one bad line or type."""
    with fs.open_input_stream(path) as f:
        text = f.read()
    lines, numbers = [], []
    for number, line in enumerate(text.split(b"\n"), start=1):
        if line.strip():  # a blank line is no row
            lines.append(line)
            numbers.append(number)
        if len(lines) >= block_lines:
            yield _lines_block(lines, numbers, path)
            lines, numbers = [], []
    if lines:
        yield _lines_block(lines, numbers, path)


def _lines_block(lines: list[bytes], numbers: list[int], path: str) -> pa.Table:
    return pa.table(
        {
            "line": pa.array(lines, pa.binary()),
            "line_number": pa.array(numbers, pa.int64()),
            "path": pa.array([path] * len(lines), pa.string()),
        }
    )
