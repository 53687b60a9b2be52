"""Row checks of batch inference: Arrow columns or parsed JSON values -> model rows plus a
reason per bad row. Plain functions of Arrow data and Python values, without Ray."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from app.data.checks import MISSING, absent
from app.data.kinds import processor
from app.data.preprocess import Column, Problems
from app.errors import UserError
from app.runtime.rows import num_features, takes_text

log = logging.getLogger(__name__)


Format = Literal["parquet", "csv", "jsonl", "pictures"]  # how an input's rows are stored


@dataclass(frozen=True)
class InputSpec:
    """The columns an artifact reads, by name, and how to check each row."""

    kind: str  # tabular | image | text | image_text | tokens
    feature_columns: tuple[str, ...]
    num_features: int
    id_column: str
    format: Format = "parquet"
    passthrough: tuple[str, ...] = ()  # input columns copied to the output as they are
    options: tuple[str, ...] = ()  # columns a row may set its own options with (may be absent)
    settings: str = ""  # the task's own settings for its actors, as JSON
    # JSON Lines: a key outside `columns` refuses its line (as HTTP refuses an unknown field)
    # rather than being ignored, where a misspelt option would silently fall back.
    closed: bool = False

    @property
    def columns(self) -> list[str]:
        return [self.id_column, *self.feature_columns, *self.passthrough, *self.options]

    @classmethod
    def of(cls, schema: dict[str, Any], id_column: str, fmt: Format = "parquet") -> InputSpec:
        """A classifier's: the artifact's feature columns, each row checked as serving does."""
        features = tuple(schema["feature_columns"])
        if id_column in features:
            raise UserError(f"--id-column {id_column!r} is one of the model's feature columns")
        return cls(
            kind=schema["kind"],
            feature_columns=features,
            num_features=1 if takes_text(schema) else num_features(schema),
            id_column=id_column,
            format=fmt,
        )


def missing_columns(present: Sequence[str], spec: InputSpec) -> list[str]:
    return [c for c in (spec.id_column, *spec.feature_columns) if c not in set(present)]


@dataclass
class CheckedBatch:
    """`raw` holds the good rows' features (float32 [n, features], or texts) in input order;
    `reasons[i]` is None for a good row i, else why row i was refused (the first problem)."""

    reasons: list[str | None]
    raw: Any = None
    good: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def check_batch(
    columns: dict[str, Column], n: int, spec: InputSpec, known: list[str | None] | None = None
) -> CheckedBatch:
    """Check every row of a batch given as named columns (Arrow arrays, or Python value lists
    for JSON lines, where a missing key reads as `MISSING`). `known`: problems found before
    (a line that is not JSON), which come first. The kind of data checks its own columns."""
    reasons: list[str | None] = list(known) if known else [None] * n
    note(reasons, id_problems(columns[spec.id_column], spec.id_column))
    kind = processor(spec.kind)
    raw, problems = kind.check_columns(columns, list(spec.feature_columns), spec.num_features)
    note(reasons, problems)
    good = np.asarray([i for i, r in enumerate(reasons) if r is None], dtype=np.int64)
    return CheckedBatch(reasons, kind.good_rows(raw, good, spec.num_features), good)


def note(reasons: list[str | None], problems: Problems) -> None:
    """Keep each row's first problem (sparse: a clean column costs nothing per row)."""
    for i, problem in problems.items():
        if reasons[i] is None:
            reasons[i] = problem


def id_problems(column: Column, name: str) -> Problems:
    if not isinstance(column, list):
        nulls = column.is_null().to_numpy(zero_copy_only=False)
        return {i: f"column {name!r}: null" for i in np.flatnonzero(nulls).tolist()}
    return {i: p for i, v in enumerate(column) if (p := absent(name, v))}


def json_line_columns(
    lines: Sequence[bytes], line_numbers: Sequence[int], paths: Sequence[str], spec: InputSpec
) -> tuple[dict[str, list[Any]], list[str | None], list[str]]:
    """JSON lines -> per-column values (MISSING where a key is absent), a problem per line that
    is not a JSON object, and each line's `file:line` (its name when the id is unusable)."""
    columns: dict[str, list[Any]] = {c: [] for c in spec.columns}
    problems: list[str | None] = []
    where = [f"{os.path.basename(p)}:{n}" for p, n in zip(paths, line_numbers, strict=True)]
    known = set(spec.columns)
    for line in lines:
        record, problem = _json_object(line)
        if problem is None and spec.closed and (extra := [k for k in record if k not in known]):
            problem = f"line: unknown field {json.dumps(extra[0])[:64]} (known: {sorted(known)})"
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
