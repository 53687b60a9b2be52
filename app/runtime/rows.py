"""A classifier's rows in and answers out, online (the replica) and offline (jobs.predict): raw
rows checked against an artifact's schema, and the graph's logits as class probabilities
(`softmax`). Text is a BYTES input, numbers an FP32 [rows, features] one; nothing here looks at
the preprocessor. Every problem is a `RequestError` naming the field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from app.data.checks import json_type, text_value
from app.runtime.types import InferRequest, RequestError, Tensor, bad

NUMERIC_DATATYPES = {
    "BOOL": None,  # refused: not a feature type
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
# A dimension above this is refused by name before any arithmetic on the shape (a client
# could otherwise send dims of thousands of digits).
MAX_DIM = 2**31 - 1

Rows = np.ndarray | list[str]  # float32 [rows, features], or one string per row


def request_rows(request: InferRequest, schema: dict[str, Any], max_rows: int) -> Rows:
    """The rows of a request, checked against the model's schema and `max_rows`."""
    tensor, spec = request.tensor, schema["inputs"][0]
    if tensor is None:
        rows = instance_rows(request.instances or [], schema)
    elif tensor.name != spec["name"]:
        raise bad(f"inputs[0].name: expected {spec['name']!r}, got {tensor.name!r}")
    elif spec["datatype"] == "BYTES":
        rows = text_tensor_rows(tensor, max_rows)
    else:
        width = int(spec["shape"][-1])
        rows = numeric_rows(
            tensor.data, "inputs[0]", width, tensor.datatype, tensor.shape, max_rows
        )
    if len(rows) > max_rows:  # counted after flattening: a text tensor [1, N] is N rows
        raise too_many_rows(len(rows), max_rows)
    return rows


def takes_text(schema: dict[str, Any]) -> bool:
    return schema["inputs"][0]["datatype"] == "BYTES"


def num_features(schema: dict[str, Any]) -> int:
    return int(schema["inputs"][0]["shape"][-1])


def text_tensor_rows(tensor: Tensor, max_rows: int) -> list[str]:
    if tensor.datatype != "BYTES":
        raise bad(f"inputs[0].datatype: expected BYTES (text), got {tensor.datatype!r}")
    claimed = claimed_rows("BYTES", tensor.shape)
    if claimed > max_rows:
        raise too_many_rows(claimed, max_rows)
    rows = text_rows(tensor.data, "inputs[0].data")
    if len(rows) != claimed:
        raise bad(f"inputs[0].shape: {tensor.shape} does not match {len(rows)} strings")
    return rows


def numeric_rows(
    data: Any,
    field: str,
    width: int,
    datatype: str = "FP32",
    shape: list[int] | None = None,
    max_rows: int | None = None,
) -> np.ndarray:
    """Numbers (nested lists or a flat list with a shape) -> float32 [n, width]. The shape is
    checked dim by dim before the data is looked at."""
    if datatype not in NUMERIC_DATATYPES or NUMERIC_DATATYPES[datatype] is None:
        raise bad(
            f"{field}.datatype: {datatype!r} is not accepted for this model; use FP32 (or another numeric type)"
        )
    if shape is not None:  # [rows, ...] whose trailing dims hold `width` values a row
        if len(shape) < 2:
            raise bad(f"{field}.shape: expected [rows, {width}], got {shape}")
        if shape[0] == 0:
            raise bad(f"{field}: empty batch (no rows)")
        if max_rows is not None and shape[0] > max_rows:
            raise too_many_rows(shape[0], max_rows)
        dims = shape[1:]
        per_row = dims[0] if len(dims) == 1 else bounded_product(dims, MAX_DIM, f"{field}.shape")
        if per_row != width:
            raise bad(f"{field}.shape: each row needs {width} values, got {per_row}")
    array = data if isinstance(data, np.ndarray) else _number_array(data, field)
    if shape is None:  # one v1 instance: a row (nested lists allowed, e.g. an 8x8 image)
        rows = array.reshape(1, -1)
    else:
        if array.size != shape[0] * width:
            raise bad(
                f"{field}.shape: {shape} holds {shape[0] * width} values but data has {array.size}"
            )
        rows = array.reshape(shape[0], -1)
    if rows.shape[0] == 0:
        raise bad(f"{field}: empty batch (no rows)")
    if rows.shape[1] != width:
        raise bad(f"{field}.shape: each row needs {width} values, got {rows.shape[1]}")
    rows = rows.astype(np.float32)
    if not np.isfinite(rows).all():
        raise bad(f"{field}: values must be finite numbers (no NaN or Infinity)")
    return rows


def _number_array(data: Any, field: str) -> np.ndarray:
    if not isinstance(data, list):
        raise bad(f"{field}: expected a list of numbers, got {type(data).__name__}")
    try:
        array = np.asarray(data)
    except ValueError:
        raise bad(f"{field}: rows have different lengths") from None
    if array.dtype.kind not in "iuf" or array.dtype == object:
        if array.size == 0:
            return array.astype(np.float64)
        raise bad(f"{field}: values must be numbers (strings, booleans and nulls are not accepted)")
    # numpy reads true as 1 beside numbers; a flat list is checked without a Python frame a row
    if bool in map(type, data) or (list in map(type, data) and _has_bool(data)):
        raise bad(f"{field}: values must be numbers (strings, booleans and nulls are not accepted)")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise bad(f"{field}: values must be finite numbers (no NaN or Infinity)")
    return array


def _has_bool(data: list[Any]) -> bool:
    for item in data:
        if item.__class__ is bool or (item.__class__ is list and _has_bool(item)):
            return True
    return False


def text_rows(data: Any, field: str) -> list[str]:
    """Strings, nested lists flattened: every string is one row (a [1, N] tensor is N rows)."""
    if not isinstance(data, list):
        # A bare string would otherwise be split into one row per character.
        raise bad(f"{field}: expected a list of strings, got {json_type(data)}")
    flat = _flatten(data)
    if not flat:
        raise bad(f"{field}: empty batch (no rows)")
    for i, item in enumerate(flat):
        flat[i], problem = text_value(item)
        if problem:
            raise bad(f"{field}[{i}]: {problem}")
    return flat


def _flatten(data: list[Any]) -> list[Any]:
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def instance_rows(instances: list[Any], schema: dict[str, Any]) -> Rows:
    """v1 instances (one per row): strings for a text model; lists of numbers, or objects of
    named features when every feature is a column of its own."""
    if takes_text(schema):
        return text_rows(instances, "instances")
    width, columns = num_features(schema), schema.get("feature_columns") or []
    if len(columns) == width and all(isinstance(i, dict) for i in instances):
        instances = [_named(instance, columns, r) for r, instance in enumerate(instances)]
    arrays = []
    for r, instance in enumerate(instances):
        if not isinstance(instance, list):
            raise bad(f"instances[{r}]: expected a list of {width} numbers")
        arrays.append(numeric_rows(instance, f"instances[{r}]", width, shape=None).reshape(-1))
    return np.stack(arrays)


def _named(instance: dict[str, Any], columns: list[str], r: int) -> list[Any]:
    """{"mean_radius": 14.1, ...}, in any order -> the values in column order."""
    missing = [c for c in columns if c not in instance]
    extra = [c for c in instance if c not in columns]
    if missing or extra:
        what = f"missing {missing[0]!r}" if missing else f"unknown feature {extra[0]!a}"
        raise bad(f"instances[{r}]: {what}")
    return [instance[c] for c in columns]


def bounded_product(dims: list[int], limit: int, field: str, status: int = 400) -> int:
    """The product of `dims`, refused as soon as it passes `limit` (no huge intermediate)."""
    product = 1
    for d in dims:
        product *= d
        if product > limit:
            raise RequestError(status, f"{field}: holds more than {limit} values")
    return product


def too_many_rows(rows: int, max_rows: int) -> RequestError:
    counted = str(rows) if rows <= MAX_DIM else f"more than {MAX_DIM}"
    return RequestError(413, f"{counted} rows exceed serve.max_request_rows={max_rows}")


def claimed_rows(datatype: str, shape: list[int]) -> int:
    """Rows a v2 tensor will be served as, before any data is read: text (BYTES) is flattened,
    so each element is a row ([1, N] is N rows); a numeric tensor's rows are its first dimension.
    At most MAX_DIM + 1 either way: a BYTES product stops once it passes that."""
    if datatype != "BYTES":
        return shape[0] if shape else 0
    product = 1
    for d in shape:
        product = min(product * d, MAX_DIM + 1)
    return product


def softmax(logits: np.ndarray) -> np.ndarray:
    """Class probabilities from logits: what the online endpoint and batch inference return."""
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)
