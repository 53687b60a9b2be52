"""The Ray Data actor: one ONNX Runtime session per actor, many batches; each batch comes
back as one table of predictions and rejected rows, which the driver splits."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from app.config import Config
from app.data.checks import MISSING, values_of
from app.data.preprocess import Column
from app.predict.row_checks import CheckedBatch, Format, InputSpec, json_line_columns
from app.registry import Part
from app.runtime.artifact import open_artifact

log = logging.getLogger(__name__)


# Columns of the actor's output table beyond the prediction itself: why a row was refused, the
# row's values as JSON (for the rejects file), and its id as text (the id itself may be bad).
REASON, ROW, ID_TEXT = "_reason", "_row", "_id_text"


MODEL_NAME, MODEL_VERSION = "model_name", "model_version"


@dataclass(frozen=True)
class PredictInput:
    """What a task's scorer reads an input by: the artifact's schema, the id column, the
    input's format and the columns its header holds, the job's config and the input's URI."""

    schema: dict[str, Any]
    id_column: str
    format: Format
    present: list[str]
    config: Config
    source: str


class Scorer(Protocol):
    """A task's batch inference (jobs.predict): a Ray Data callable class built once per actor,
    each batch in, one table of its outputs and its rejected rows out (`outputs_table`), and
    the input columns it reads (`input_spec`)."""

    def __call__(
        self, artifact_uri: str, variant: str, threads: int, spec: InputSpec, /
    ) -> Any: ...

    def input_spec(self, request: PredictInput, /) -> InputSpec: ...


PREDICTOR = Part[Scorer]("predictor")


class ArtifactBatches:
    """What every task's batch scorer shares: the artifact (verified again in the actor), the
    input spec, and a batch as named columns."""

    def __init__(self, artifact_uri: str, spec: InputSpec):
        self.artifact = open_artifact(artifact_uri)
        self.spec = spec

    @property
    def meta(self) -> tuple[str, str]:
        return self.artifact.name, self.artifact.version

    def columns(
        self, batch: pa.Table
    ) -> tuple[dict[str, Column], int, list[str | None], list[str] | None]:
        """The batch's columns by name, its size, problems found reading it (JSON lines that
        are not objects), and each row's `file:line` for JSON lines."""
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


def outputs_table(
    columns: dict[str, Column],
    id_column: str,
    checked: CheckedBatch,
    outputs: dict[str, pa.Array],
    where: list[str] | None,
    meta: tuple[str, str],
) -> pa.Table:
    """The good rows (id, the task's outputs, model) then the bad ones (reason, row, id text),
    in one table so that one map_batches output carries both; the driver splits them."""
    good = checked.good
    bad = np.asarray([i for i, r in enumerate(checked.reasons) if r is not None], np.int64)
    ids = good_values(columns[id_column], good)
    nb = len(bad)
    table = {id_column: pa.concat_arrays([ids, pa.nulls(nb, ids.type)])}
    for name, values in outputs.items():
        table[name] = pa.concat_arrays([values, pa.nulls(nb, values.type)])
    table |= {
        MODEL_NAME: pa.array([meta[0]] * (len(good) + nb), pa.string()),
        MODEL_VERSION: pa.array([meta[1]] * (len(good) + nb), pa.string()),
        REASON: pa.array([None] * len(good) + [checked.reasons[i] for i in bad], pa.string()),
        ROW: pa.array([None] * len(good) + _raw_rows(columns, bad), pa.string()),
        ID_TEXT: pa.array(
            [None] * len(good) + _id_texts(columns[id_column], bad, where), pa.string()
        ),
    }
    return pa.table(table)


def good_values(column: Column, good: np.ndarray) -> pa.Array:
    """A column's values at the good rows, as one Arrow array."""
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
    values = values_of(column)
    out = []
    for i in bad:
        value = values[i]
        usable = value is not None and value is not MISSING
        out.append(_as_text(value) if usable else (where[i] if where else "null"))
    return out


def _raw_rows(columns: dict[str, Column], bad: np.ndarray) -> list[str]:
    values = {name: values_of(col) for name, col in columns.items()} if len(bad) else {}
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


def split_predictions(table: pa.Table, id_column: str) -> tuple[pa.Table, pa.Table]:
    """The actor's table -> (predictions, rejects: id as text, reason, the row as JSON)."""
    bad_mask = table[REASON].is_valid()
    good = table.filter(pc.invert(bad_mask)).drop([REASON, ROW, ID_TEXT])
    bad = table.filter(bad_mask).select([ID_TEXT, REASON, ROW])
    return good, bad.rename_columns(["id", "reason", "row"])
