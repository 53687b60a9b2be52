"""Row checks of batch inference: Arrow columns or parsed JSON values -> model rows plus a
reason per bad row. Plain functions of Arrow data and Python values, without Ray."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from app.errors import UserError
from app.serve.rows import num_features, takes_text, text_value

log = logging.getLogger(__name__)


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
        features = tuple(schema["feature_columns"])
        if id_column in features:
            raise UserError(f"--id-column {id_column!r} is one of the model's feature columns")
        width = 1 if takes_text(schema) else num_features(schema)
        return cls(schema["kind"], features, width, id_column, fmt)  # type: ignore[arg-type]


def missing_columns(present: Sequence[str], spec: InputSpec) -> list[str]:
    return [c for c in spec.columns if c not in set(present)]


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
        problem = _absent(name, value)
        text = ""
        if problem is None:
            text, why = text_value(value)  # the serving replica's own check
            problem = f"column {name!r}: {why}" if why else None
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
