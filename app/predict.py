"""Predict: offline batch inference with an exported artifact, published like every other stage.

    --input (Parquet | CSV | JSONL file, or a folder of one of them)
      -> Ray Data read (only the id column and the artifact's feature or text columns)
      -> map_batches(Predictor) in an autoscaling actor pool (1 .. predict.max_actors); each
         actor opens the artifact and builds its ONNX Runtime session once, then per batch:
         check rows -> the artifact's preprocessor -> ONNX Runtime -> label, probabilities
      -> the driver writes <output>/part-*.parquet (id, label, probabilities, model_name,
         model_version), rejects/part-*.parquet (id, reason, row) and manifest.json LAST

Columns are matched by name to the artifact's `schema.json` (`feature_columns`; for text its one
column). A column missing from a whole file fails the job at once, naming it. A malformed row
(null or missing value, not a number, NaN or infinity, undecodable or invalid text, bad JSON
line) is a bad row: `predict.on_bad_rows=fail` stops the job naming the first ones (exit 1,
nothing published), `reject` writes each with its reason to `rejects/`. Every input row ends in
exactly one of the two outputs; the summary asserts output + rejected == input rows.

The row checks (`check_batch`) are plain functions of Arrow data and Python values, without Ray.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from app import storage
from app.config import Config, PredictConfig
from app.data.prepare import Shard, sha256_file
from app.errors import UserError
from app.export.artifact import open_artifact, run_logits, softmax

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
REJECTS = "rejects"
FORMATS: dict[str, Literal["parquet", "csv", "jsonl"]] = {
    ".parquet": "parquet",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
}
# Columns of the actor's output table beyond the prediction itself: why a row was refused, the
# row's values as JSON (for the rejects file), and its id as text (the id itself may be bad).
REASON, ROW, ID_TEXT = "_reason", "_row", "_id_text"
MODEL_NAME, MODEL_VERSION = "model_name", "model_version"


# --- what the input must hold ------------------------------------------------------------------


@dataclass(frozen=True)
class InputSpec:
    """The columns an artifact reads, by name, and how to check each row."""

    kind: str  # tabular | image | text
    feature_columns: tuple[str, ...]
    num_features: int
    id_column: str
    format: Literal["parquet", "csv", "jsonl"] = "parquet"

    @property
    def columns(self) -> list[str]:
        return [self.id_column, *self.feature_columns]

    @classmethod
    def of(cls, schema: dict[str, Any], id_column: str, fmt: str = "parquet") -> InputSpec:
        kind = schema["kind"]
        features = tuple(schema["feature_columns"])
        if id_column in features:
            raise UserError(f"--id-column {id_column!r} is one of the model's feature columns")
        width = schema["inputs"][0]["shape"][-1]
        return cls(kind, features, 1 if kind == "text" else int(width), id_column, fmt)  # type: ignore[arg-type]


def missing_columns(present: Sequence[str], spec: InputSpec) -> list[str]:
    return [c for c in spec.columns if c not in set(present)]


# --- row checks: Arrow columns or parsed JSON values -> model rows + a reason per bad row --------


@dataclass
class CheckedBatch:
    """`raw` holds the good rows' features (float32 [n, features], or texts) in input order;
    `reasons[i]` is None for a good row i, else why row i was refused (the first problem)."""

    reasons: list[str | None]
    raw: Any = None
    good: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


Column: TypeAlias = "pa.Array | pa.ChunkedArray | list[Any]"


def check_batch(
    columns: dict[str, Column], n: int, spec: InputSpec, known: list[str | None] | None = None
) -> CheckedBatch:
    """Check every row of a batch given as named columns (Arrow arrays, or Python value lists
    for JSON lines, where a missing key reads as `MISSING`). `known`: problems found before
    (a line that is not JSON), which come first."""
    reasons: list[str | None] = list(known) if known else [None] * n
    _note(reasons, _id_problems(columns[spec.id_column], spec.id_column))
    if spec.kind == "text":
        texts, problems = _texts(columns[spec.feature_columns[0]], spec.feature_columns[0])
        _note(reasons, problems)
    elif spec.kind == "image":
        pixels, problems = _pixels(columns[spec.feature_columns[0]], spec)
        _note(reasons, problems)
    else:
        matrix = np.empty((n, spec.num_features), np.float32)
        for j, name in enumerate(spec.feature_columns):
            matrix[:, j], problems = _numbers(columns[name], name)
            _note(reasons, problems)
    good = np.asarray([i for i, r in enumerate(reasons) if r is None], dtype=np.int64)
    if spec.kind == "text":
        raw: Any = [texts[i] for i in good]
    elif spec.kind == "image":
        raw = pixels[good] if len(good) else np.zeros((0, spec.num_features), np.float32)
    else:
        raw = matrix[good]
    return CheckedBatch(reasons, raw, good)


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()  # a JSON line without the key (distinct from an explicit null)


Problems: TypeAlias = dict[int, str]  # row -> what is wrong with it; only bad rows are listed


def _note(reasons: list[str | None], problems: Problems) -> None:
    """Keep each row's first problem (sparse: a clean column costs nothing per row)."""
    for i, problem in problems.items():
        if reasons[i] is None:
            reasons[i] = problem


def _values(column: Column) -> list[Any]:
    return column if isinstance(column, list) else column.to_pylist()


def _absent(name: str, value: Any) -> str | None:
    if value is MISSING:
        return f"column {name!r}: missing"
    if value is None:
        return f"column {name!r}: null"
    return None


def _id_problems(column: Column, name: str) -> Problems:
    if not isinstance(column, list):
        nulls = column.is_null().to_numpy(zero_copy_only=False)
        return {i: f"column {name!r}: null" for i in np.flatnonzero(nulls).tolist()}
    return {i: p for i, v in enumerate(column) if (p := _absent(name, v))}


def _numbers(column: Column, name: str) -> tuple[np.ndarray, Problems]:
    """One feature column -> float32 values and a problem per bad row."""
    if not isinstance(column, list) and _is_numeric(column.type):
        # The fast path (Parquet, typed CSV): one vectorised pass, Python only for bad rows.
        values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
        nulls = column.is_null().to_numpy(zero_copy_only=False)
        problems: Problems = {}
        for bad in np.flatnonzero(nulls | ~np.isfinite(values)).tolist():
            problems[bad] = (
                f"column {name!r}: null" if nulls[bad] else _not_finite(name, values[bad])
            )
        return values.astype(np.float32), problems
    out, problems = np.zeros(len(column), np.float32), {}
    for i, value in enumerate(_values(column)):
        out[i], problem = _number(value, name)
        if problem:
            problems[i] = problem
    return out, problems


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def _not_finite(name: str, value: float) -> str:
    return f"column {name!r}: not a finite number ({value})"


def _number(value: Any, name: str) -> tuple[float, str | None]:
    """A raw value (CSV bytes, JSON value) -> (number, None) or (0, why not)."""
    problem = _absent(name, value)
    if problem:
        return 0.0, problem
    if isinstance(value, bool):
        return 0.0, f"column {name!r}: expected a number, got a boolean"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return 0.0, f"column {name!r}: not valid UTF-8 text"
    if isinstance(value, str):
        if not value.strip():
            return 0.0, f"column {name!r}: empty"
        try:
            value = float(value)
        except ValueError:
            return 0.0, f"column {name!r}: not a number ({_short(value)})"
    if not isinstance(value, int | float):
        return 0.0, f"column {name!r}: expected a number, got {type(value).__name__}"
    if not math.isfinite(value):
        return 0.0, _not_finite(name, value)
    return float(value), None


def _texts(column: Column, name: str) -> tuple[list[str], Problems]:
    texts: list[str] = []
    problems: Problems = {}
    for i, value in enumerate(_values(column)):
        text, problem = "", _absent(name, value)
        if problem is None and isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                problem = f"column {name!r}: not valid UTF-8 text"
        if problem is None and not isinstance(value, str):
            problem = f"column {name!r}: expected text, got {type(value).__name__}"
        if problem is None:
            try:  # the tokenizer refuses lone surrogates (JSON can carry them)
                value.encode("utf-8")
                text = value
            except UnicodeEncodeError as e:
                problem = f"column {name!r}: not valid Unicode (lone surrogate at {e.start})"
        texts.append(text)
        if problem:
            problems[i] = problem
    return texts, problems


def _pixels(column: Column, spec: InputSpec) -> tuple[np.ndarray, Problems]:
    name, width = spec.feature_columns[0], spec.num_features
    out, problems = np.zeros((len(column), width), np.float32), {}
    for i, value in enumerate(_values(column)):
        problem = _absent(name, value)
        if problem is None and isinstance(value, str | bytes):
            try:  # a list written as JSON text (CSV)
                value = json.loads(value)
            except ValueError:
                problem = f"column {name!r}: not a list of {width} numbers"
        if problem is None:
            out[i], problem = _pixel_row(value, name, width)
        if problem:
            problems[i] = problem
    return out, problems


def _pixel_row(value: Any, name: str, width: int) -> tuple[np.ndarray, str | None]:
    zeros = np.zeros(width, np.float32)
    try:
        row = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return zeros, f"column {name!r}: not a list of numbers"
    if row.size != width:
        return zeros, f"column {name!r}: expected {width} values, got {row.size}"
    if not np.isfinite(row).all():
        return zeros, f"column {name!r}: not all values are finite numbers"
    return row.astype(np.float32), None


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def json_line_columns(
    lines: Sequence[bytes], line_numbers: Sequence[int], paths: Sequence[str], spec: InputSpec
) -> tuple[dict[str, list[Any]], list[str | None], list[str]]:
    """JSON lines -> per-column values (MISSING where a key is absent), a problem per line that
    is not a JSON object, and each line's `file:line` (its name when the id is unusable)."""
    columns: dict[str, list[Any]] = {c: [] for c in spec.columns}
    problems: list[str | None] = []
    where = [f"{os.path.basename(p)}:{n}" for p, n in zip(paths, line_numbers, strict=True)]
    for line in lines:
        record, problem = _json_object(line)
        problems.append(problem)
        for name in spec.columns:
            columns[name].append(record.get(name, MISSING))
    return columns, problems, where


def _json_object(line: bytes) -> tuple[dict[str, Any], str | None]:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return {}, "line: not valid UTF-8 text"
    except ValueError as e:
        return {}, f"line: not valid JSON ({str(e).splitlines()[0][:60]})"
    if not isinstance(record, dict):
        return {}, f"line: expected a JSON object, got {type(record).__name__}"
    return record, None


# --- the actor: one ONNX Runtime session, many batches -------------------------------------------


class Predictor:
    """A Ray Data callable class: the artifact and its session are built once per actor."""

    def __init__(self, artifact_uri: str, variant: str, threads: int, spec: InputSpec):
        self.artifact = open_artifact(artifact_uri)  # verifies every sha256 again, in the actor
        self.session = self.artifact.session(variant, threads)
        self.spec = spec
        self.labels = np.asarray(self.artifact.preprocessor.labels, dtype=object)

    def __call__(self, batch: pa.Table) -> pa.Table:
        columns, n, known, where = self._columns(batch)
        checked = check_batch(columns, n, self.spec, known)
        probabilities = self._probabilities(checked)
        return predictions_table(
            columns, self.spec.id_column, checked, probabilities, self.labels, where, self.meta
        )

    @property
    def meta(self) -> tuple[str, str]:
        return self.artifact.name, self.artifact.version

    def _columns(
        self, batch: pa.Table
    ) -> tuple[dict[str, Column], int, list[str | None], list[str] | None]:
        if self.spec.format == "jsonl":
            columns, problems, where = json_line_columns(
                batch["line"].to_pylist(),
                batch["line_number"].to_pylist(),
                batch["path"].to_pylist(),
                self.spec,
            )
            return dict(columns), batch.num_rows, problems, where
        # A file without a column was refused up front; a batch that still lacks one (files
        # read with different schemas) has every row refused for it.
        columns = {
            c: batch[c] if c in batch.column_names else [MISSING] * batch.num_rows
            for c in self.spec.columns
        }
        return columns, batch.num_rows, [None] * batch.num_rows, None

    def _probabilities(self, checked: CheckedBatch) -> np.ndarray:
        if not len(checked.good):
            return np.zeros((0, len(self.labels)), np.float32)
        inputs = self.artifact.preprocessor.features(checked.raw)
        return softmax(run_logits(self.session, inputs)).astype(np.float32)


def predictions_table(
    columns: dict[str, Column],
    id_column: str,
    checked: CheckedBatch,
    probabilities: np.ndarray,
    labels: np.ndarray,
    where: list[str] | None,
    meta: tuple[str, str],
) -> pa.Table:
    """The good rows (id, label, probabilities, model) then the bad ones (reason, row, id text),
    in one table so that one map_batches output carries both; the driver splits them."""
    good = checked.good
    bad = np.asarray([i for i, r in enumerate(checked.reasons) if r is not None], np.int64)
    ids = _good_ids(columns[id_column], good)
    k = probabilities.shape[1]
    flat = pa.array(probabilities.reshape(-1), pa.float32())
    probs = pa.FixedSizeListArray.from_arrays(flat, k).cast(pa.list_(pa.float32()))
    label = pa.array(labels[probabilities.argmax(1)].tolist() if len(good) else [], pa.string())
    nb = len(bad)
    table = {
        id_column: pa.concat_arrays([ids, pa.nulls(nb, ids.type)]),
        "label": pa.concat_arrays([label, pa.nulls(nb, pa.string())]),
        "probabilities": pa.concat_arrays([probs, pa.nulls(nb, probs.type)]),
        MODEL_NAME: pa.array([meta[0]] * (len(good) + nb), pa.string()),
        MODEL_VERSION: pa.array([meta[1]] * (len(good) + nb), pa.string()),
        REASON: pa.array([None] * len(good) + [checked.reasons[i] for i in bad], pa.string()),
        ROW: pa.array([None] * len(good) + _raw_rows(columns, bad), pa.string()),
        ID_TEXT: pa.array(
            [None] * len(good) + _id_texts(columns[id_column], bad, where), pa.string()
        ),
    }
    return pa.table(table)


def _good_ids(column: Column, good: np.ndarray) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        return column.take(pa.array(good, pa.int64())).combine_chunks()
    if isinstance(column, pa.Array):
        return column.take(pa.array(good, pa.int64()))
    values = [column[i] for i in good]
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # ids of mixed JSON types: keep them as text
        return pa.array([str(v) for v in values], pa.string())


def _id_texts(column: Column, bad: np.ndarray, where: list[str] | None) -> list[str]:
    values = _values(column)
    out = []
    for i in bad:
        value = values[i]
        usable = value is not None and value is not MISSING
        out.append(_as_text(value) if usable else (where[i] if where else "null"))
    return out


def _raw_rows(columns: dict[str, Column], bad: np.ndarray) -> list[str]:
    values = {name: _values(col) for name, col in columns.items()} if len(bad) else {}
    return [
        json.dumps(
            {k: v[i] for k, v in values.items() if v[i] is not MISSING},
            default=_as_text,
            ensure_ascii=False,
        )
        for i in bad
    ]


def _as_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


# --- reading the input ---------------------------------------------------------------------------


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


# --- writing the output ------------------------------------------------------------------------


class PartWriter:
    """Parquet parts of at most `rows_per_file` rows in a local folder, hashed as they close."""

    def __init__(self, folder: str, rel: str, rows_per_file: int, run: str):
        self.folder, self.rel, self.rows_per_file, self.run = folder, rel, rows_per_file, run
        self.shards: list[Shard] = []
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._path, self._part_rows, self.schema = "", 0, None

    def write(self, table: pa.Table) -> None:
        if self.schema is None:
            self.schema = table.schema
        table = self._conform(table)
        while table.num_rows:
            if self._writer is None:
                self._open()
            take = min(table.num_rows, self.rows_per_file - self._part_rows)
            self._writer.write_table(table.slice(0, take))  # type: ignore[union-attr]
            self._part_rows += take
            self.rows += take
            table = table.slice(take)
            if self._part_rows >= self.rows_per_file:
                self._close()

    def _conform(self, table: pa.Table) -> pa.Table:
        """Every part has the first batch's schema (an id column read as int in one file and as
        text in another is refused, naming it, rather than written as two schemas)."""
        if table.schema.equals(self.schema):
            return table
        try:
            return table.cast(self.schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as e:
            raise UserError(
                f"input: column types differ between files or rows ({str(e).splitlines()[0][:120]})"
            ) from None

    def _open(self) -> None:
        name = f"part-{len(self.shards):05d}-{self.run}.parquet"
        self._path = (
            os.path.join(self.folder, self.rel, name)
            if self.rel
            else os.path.join(self.folder, name)
        )
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        self._writer = pq.ParquetWriter(self._path, self.schema)
        self._part_rows = 0

    def _close(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        rel = os.path.relpath(self._path, self.folder)
        self.shards.append(Shard(file=rel, rows=self._part_rows, sha256=sha256_file(self._path)))

    def close(self) -> list[Shard]:
        self._close()
        return self.shards


class PredictionManifest(storage.Contract):
    """`<output>/manifest.json`: what a predict run wrote, with every file's sha256; written last."""

    stage: Literal["predict"] = "predict"
    created: str
    artifact: str
    model_name: str
    model_version: str
    variant: str
    input: str
    input_format: str
    id_column: str
    on_bad_rows: str
    rows: dict[str, int]  # input, output, rejected
    files: list[Shard]  # relative to the output folder
    rejects: list[Shard]
    bad_row_examples: list[dict[str, str]] = []


def verify_output(uri: str) -> PredictionManifest:
    """The manifest of a predict output, every listed file hashed against it (one line naming a
    missing or altered file)."""
    manifest = PredictionManifest.read(storage.join(uri, MANIFEST))
    for shard in [*manifest.files, *manifest.rejects]:
        target = storage.join(uri, shard.file)
        try:
            digest = storage.sha256(target)
        except FileNotFoundError:
            raise UserError(f"{target}: missing (listed in {MANIFEST})") from None
        if digest != shard.sha256:
            raise UserError(f"{target}: sha256 differs from {MANIFEST} (altered or truncated)")
    return manifest


def publish(local: str, output: str) -> None:
    """Local disk: the caller filled a `staged_dir`, renamed into place on return. Object
    stores: every file, then the manifest LAST (the commit point), then the files of an earlier
    run that the new manifest does not list."""
    if storage.is_local(output):
        return
    names = [os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs]
    for rel in sorted(n for n in names if n != MANIFEST):
        storage.upload_file(os.path.join(local, rel), storage.join(output, rel))
    storage.upload_file(os.path.join(local, MANIFEST), storage.join(output, MANIFEST))
    for folder in (output, storage.join(output, REJECTS)):
        for name in storage.list_dir(folder):
            rel = os.path.relpath(storage.join(folder, name), output)
            if name.startswith("part-") and rel not in names:
                storage.delete_file(storage.join(folder, name))


def refuse_foreign_output(output: str) -> None:
    """Never replace a folder that is not an earlier predict output (a typo in --output)."""
    if not storage.exists(output) or not storage.list_dir(output):
        return
    if not storage.is_file(storage.join(output, MANIFEST)):
        raise UserError(f"{output}: exists and is not a predict output; choose another --output")
    PredictionManifest.read(storage.join(output, MANIFEST))  # refuses another stage's manifest


# --- the stage ----------------------------------------------------------------------------------


@dataclass
class Tally:
    """Rows so far, and the first bad ones (id + reason) for the summary or the failure."""

    max_examples: int
    output: int = 0
    rejected: int = 0
    examples: list[dict[str, str]] = field(default_factory=list)

    def add(self, good: int, bad: pa.Table) -> None:
        self.output += good
        self.rejected += bad.num_rows
        room = self.max_examples - len(self.examples)
        for row in bad.slice(0, max(room, 0)).to_pylist():
            self.examples.append({"id": row["id"], "reason": row["reason"]})

    def line(self) -> str:
        return "; ".join(f"id {e['id']}: {e['reason']}" for e in self.examples)


def split_predictions(table: pa.Table, id_column: str) -> tuple[pa.Table, pa.Table]:
    """The actor's table -> (predictions, rejects: id as text, reason, the row as JSON)."""
    bad_mask = table[REASON].is_valid()
    good = table.filter(pc.invert(bad_mask)).select(
        [id_column, "label", "probabilities", MODEL_NAME, MODEL_VERSION]
    )
    bad = table.filter(bad_mask).select([ID_TEXT, REASON, ROW])
    return good, bad.rename_columns(["id", "reason", "row"])


def predict(
    config: Config, artifact_uri: str, input_uri: str, output: str, id_column: str = "id"
) -> dict[str, Any]:
    from app.cli import connect_ray

    started = time.perf_counter()
    cfg = config.predict
    fmt, files = input_files(input_uri)
    artifact = open_artifact(artifact_uri)  # verified once here; resolves `latest` for every actor
    spec = InputSpec.of(artifact.schema, id_column, fmt)
    expected_rows = check_columns(files, spec)
    output = output.rstrip("/")
    refuse_foreign_output(output)
    variant = cfg.variant or config.serve.variant
    log.info(
        "predict: %s %s (%s) on %d %s file(s) from %s -> %s",
        artifact.name,
        artifact.version,
        variant,
        len(files),
        fmt,
        input_uri,
        output,
    )
    connect_ray()
    ds = _pipeline(config, files, spec, artifact.uri, variant)
    with _output_folder(output) as local:
        tally, (parts, rejects) = _write(ds, local, spec, cfg)
        rows = {
            "input": tally.output + tally.rejected,
            "output": tally.output,
            "rejected": tally.rejected,
        }
        # Every row read comes out as a prediction or a reject; for Parquet the files' own
        # metadata gives an independent count.
        if expected_rows is not None and expected_rows != rows["input"]:
            raise UserError(
                f"predict: read {rows['input']} rows, the input holds {expected_rows}; "
                "nothing published"
            )
        manifest = PredictionManifest(
            created=datetime.now(timezone.utc).isoformat(),
            artifact=artifact.uri,
            model_name=artifact.name,
            model_version=artifact.version,
            variant=variant,
            input=input_uri,
            input_format=fmt,
            id_column=id_column,
            on_bad_rows=cfg.on_bad_rows,
            rows=rows,
            files=parts,
            rejects=rejects,
            bad_row_examples=tally.examples,
        )
        manifest.write(os.path.join(local, MANIFEST))  # last: the output counts only with it
        publish(local, output)
    elapsed = time.perf_counter() - started
    log.info("predict: %s in %.1f s", rows, elapsed)
    return {
        "stage": "predict",
        "output": output,
        "rejects": storage.join(output, REJECTS) if tally.rejected else None,
        "artifact": artifact.uri,
        "model": artifact.name,
        "version": artifact.version,
        "variant": variant,
        "rows": rows,
        "bad_rows": {"count": tally.rejected, "examples": tally.examples},
        "elapsed_s": round(elapsed, 3),
        "rows_per_s": round(rows["input"] / elapsed, 1) if elapsed else None,
    }


def _pipeline(config: Config, files: list[str], spec: InputSpec, artifact_uri: str, variant: str):
    import ray
    import ray.data

    from app.data.ingest import quiet_progress

    cfg = config.predict
    quiet_progress()
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else ray.cluster_resources().get("GPU", 0) > 0
    return read_input(files, spec, config.data.task_cpus).map_batches(
        Predictor,
        fn_constructor_args=(artifact_uri, variant, cfg.threads, spec),
        batch_format="pyarrow",
        batch_size=cfg.batch_size,
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=cfg.max_actors),
        num_cpus=cfg.actor_cpus,
        num_gpus=cfg.gpus_per_actor if use_gpu else None,
    )


def _write(ds, local: str, spec: InputSpec, cfg: PredictConfig):
    run = uuid.uuid4().hex[:8]
    predictions = PartWriter(local, "", cfg.rows_per_file, run)
    rejects = PartWriter(local, REJECTS, cfg.rows_per_file, run)
    tally = Tally(cfg.max_examples)
    last_log = time.monotonic()
    for table in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        good, bad = split_predictions(table, spec.id_column)
        tally.add(good.num_rows, bad)
        if bad.num_rows and cfg.on_bad_rows == "fail":
            raise UserError(
                f"input: malformed rows ({tally.rejected} in the first "
                f"{tally.output + tally.rejected} read): {tally.line()}; "
                "predict.on_bad_rows=reject writes them to <output>/rejects instead"
            )
        if good.num_rows:
            predictions.write(good)
        if bad.num_rows:
            rejects.write(bad)
        if time.monotonic() - last_log > 10:
            log.info("predict: %d rows predicted, %d rejected", tally.output, tally.rejected)
            last_log = time.monotonic()
    return tally, (predictions.close(), rejects.close())


@contextlib.contextmanager
def _output_folder(output: str) -> Iterator[str]:
    """A local folder to fill: a staged folder renamed into `output` on success (local disk),
    or a temporary one that `publish` uploads (object stores)."""
    if storage.is_local(output):
        with storage.staged_dir(output) as local:
            yield local
    else:
        with tempfile.TemporaryDirectory(prefix="predict-") as local:
            yield local
