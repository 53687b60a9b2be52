"""Checks of raw values read from a file or sent in a request, Ray-free: numbers, texts and
pixel lists, each bad row with why (the kinds' `check_columns`, jobs.predict, the replicas)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from app.data.preprocess import Column, Problems


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()  # a JSON line without the key (distinct from an explicit null)


def values_of(column: Column) -> list[Any]:
    return column if isinstance(column, list) else column.to_pylist()


def absent(name: str, value: Any) -> str | None:
    if value is MISSING:
        return f"column {name!r}: missing"
    if value is None:
        return f"column {name!r}: null"
    return None


def numbers(column: Column, name: str) -> tuple[np.ndarray, Problems]:
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
    for i, value in enumerate(values_of(column)):
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
    problem = absent(name, value)
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


def texts(column: Column, name: str) -> tuple[list[str], Problems]:
    texts: list[str] = []
    problems: Problems = {}
    for i, value in enumerate(values_of(column)):
        problem = absent(name, value)
        text = ""
        if problem is None:
            text, why = text_value(value)  # the serving replica's own check
            problem = f"column {name!r}: {why}" if why else None
        texts.append(text)
        if problem:
            problems[i] = problem
    return texts, problems


def pixels(column: Column, name: str, width: int) -> tuple[np.ndarray, Problems]:
    out, problems = np.zeros((len(column), width), np.float32), {}
    for i, value in enumerate(values_of(column)):
        problem = absent(name, value)
        if problem is None and isinstance(value, str | bytes):
            value, problem = _pixel_text(value, name, width)
        if problem is None:
            out[i], problem = _pixel_row(value, name, width)
        if problem:
            problems[i] = problem
    return out, problems


def _pixel_text(value: str | bytes, name: str, width: int) -> tuple[Any, str | None]:
    """A list written as JSON text (CSV), or a row as prepared shards store it (its pixels'
    bytes: `width` uint8 values, or float32 at four bytes each; such bytes are not JSON text,
    which is tried first)."""
    try:
        return json.loads(value), None
    except ValueError:
        pass
    if isinstance(value, bytes) and len(value) in (width, 4 * width):
        return np.frombuffer(value, np.uint8 if len(value) == width else np.float32), None
    return None, f"column {name!r}: not a list of {width} numbers"


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


def text_value(value: Any) -> tuple[str, str | None]:
    """One raw value as text, or why it is not (online rows and batch inference alike): bytes
    must be UTF-8, and a string valid Unicode (JSON can carry lone surrogates, which the
    tokenizer refuses for the whole batch it is given)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            return "", f"not valid UTF-8 (byte {e.start})"
    if not isinstance(value, str):
        return "", f"expected a string, got {json_type(value)}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return "", f"not valid Unicode text (lone surrogate at character {e.start})"
    return value, None


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages ("got null", not "got NoneType")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else type(value).__name__


# --- Open Inference Protocol v2 -----------------------------------------------------------------
