"""Request parsing and validation, response encoding: the HTTP contract without Ray or FastAPI.

Every problem with a request is a `RequestError` carrying the HTTP status and a message naming the
field; nothing here raises anything else on bad input.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

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
BINARY_HEADER = "inference-header-content-length"


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def bad(message: str, status: int = 400) -> RequestError:
    return RequestError(status, message)


# --- JSON ---------------------------------------------------------------------------------------


def _no_constants(token: str) -> float:
    raise ValueError(f"{token} is not allowed (numbers must be finite)")


def parse_json(body: bytes, what: str = "body") -> Any:
    if not body.strip():
        raise bad(f"{what}: empty; expected a JSON object")
    try:
        return json.loads(body, parse_constant=_no_constants)
    except RecursionError:
        raise bad(f"{what}: JSON nested too deeply") from None
    except UnicodeDecodeError:
        raise bad(f"{what}: not UTF-8 text") from None
    except ValueError as e:
        raise bad(f"{what}: not valid JSON ({str(e).splitlines()[0][:120]})") from None


def check_content_type(content_type: str | None, binary: bool) -> None:
    """JSON, or octet-stream with the binary extension; a missing Content-Type reads as JSON."""
    if not content_type:
        return
    media = content_type.split(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return
    if binary and media == "application/octet-stream":
        return
    raise bad(f"Content-Type {media!r} is not supported; send application/json", 415)


# --- raw rows: what the model server validates against schema.json ----------------------------


def numeric_rows(
    data: Any, field: str, num_features: int, datatype: str = "FP32", shape: list[int] | None = None
) -> np.ndarray:
    """Numbers (nested lists or a flat list with a shape) -> float32 [n, num_features]."""
    if datatype not in NUMERIC_DATATYPES or NUMERIC_DATATYPES[datatype] is None:
        raise bad(
            f"{field}.datatype: {datatype!r} is not accepted for this model; use FP32 (or another numeric type)"
        )
    array = data if isinstance(data, np.ndarray) else _number_array(data, field)
    if shape is None:  # one v1 instance: a row (nested lists allowed, e.g. an 8x8 image)
        rows = array.reshape(1, -1)
    else:
        if array.size != math.prod(shape):
            raise bad(
                f"{field}.shape: {shape} holds {math.prod(shape)} values but data has {array.size}"
            )
        if len(shape) < 2:
            raise bad(f"{field}.shape: expected [rows, {num_features}], got {shape}")
        if shape[0] == 0:
            raise bad(f"{field}: empty batch (no rows)")
        rows = array.reshape(shape[0], -1)
    if rows.shape[0] == 0:
        raise bad(f"{field}: empty batch (no rows)")
    if rows.shape[1] != num_features:
        raise bad(f"{field}.shape: each row needs {num_features} values, got {rows.shape[1]}")
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
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise bad(f"{field}: values must be finite numbers (no NaN or Infinity)")
    return array


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


def text_rows(data: Any, field: str) -> list[str]:
    """Strings, nested lists flattened: every string is one row (a [1, N] tensor is N rows)."""
    if not isinstance(data, list):
        # A bare string would otherwise be split into one row per character.
        raise bad(f"{field}: expected a list of strings, got {json_type(data)}")
    flat = _flatten(data)
    if not flat:
        raise bad(f"{field}: empty batch (no rows)")
    for i, item in enumerate(flat):
        if isinstance(item, bytes):
            flat[i] = item.decode("utf-8", errors="replace")
        elif not isinstance(item, str):
            raise bad(f"{field}[{i}]: expected a string, got {json_type(item)}")
    _check_unicode(flat, field)
    return flat


def _check_unicode(texts: list[str], field: str) -> None:
    # JSON may carry lone surrogates ("\ud800"); the tokenizer refuses them, and it tokenizes a
    # whole batch at once, so one such string must be refused here, alone, by name.
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(
                    f"{field}[{i}]: not valid Unicode text (lone surrogate at character {e.start})"
                ) from None


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


# --- Open Inference Protocol v2 -----------------------------------------------------------------


def split_binary(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    try:
        n = int(header_length)
    except ValueError:
        raise bad("Inference-Header-Content-Length: not an integer") from None
    if n < 0 or n > len(body):
        raise bad(f"Inference-Header-Content-Length: {n} is outside the body ({len(body)} bytes)")
    return body[:n], body[n:]


def decode_v2(body: bytes, header_length: str | None) -> dict[str, Any]:
    """-> {"id", "tensor": {"name","datatype","shape","data"}, "binary_outputs": set[str]}"""
    json_part, binary = split_binary(body, header_length)
    request = parse_json(json_part)
    if not isinstance(request, dict):
        raise bad("body: expected a JSON object with 'inputs'")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise bad("inputs: expected a non-empty list with one tensor")
    if len(inputs) != 1:
        raise bad(f"inputs: this model takes one input tensor, got {len(inputs)}")
    tensor = inputs[0]
    if not isinstance(tensor, dict):
        raise bad("inputs[0]: expected an object")
    for key in ("name", "datatype", "shape"):
        if key not in tensor:
            raise bad(f"inputs[0].{key}: missing")
    shape = tensor["shape"]
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise bad("inputs[0].shape: expected a list of non-negative integers")
    for key in ("name", "datatype"):
        if not isinstance(tensor[key], str):
            raise bad(f"inputs[0].{key}: expected a string, got {json_type(tensor[key])}")
    size = parameters(tensor, "inputs[0].parameters").get("binary_data_size")
    if size is not None:
        tensor = {**tensor, "data": _binary_tensor(binary, size, tensor["datatype"], shape)}
    elif "data" not in tensor:
        raise bad("inputs[0].data: missing")
    elif not isinstance(tensor["data"], list):
        # A string would be read as one row per character, a number or null not at all.
        raise bad(f"inputs[0].data: expected a list, got {json_type(tensor['data'])}")
    return {"id": request.get("id"), "tensor": tensor, "binary_outputs": _binary_outputs(request)}


def parameters(holder: dict[str, Any], field: str) -> dict[str, Any]:
    """The optional `parameters` object of a request, input or output (null reads as absent)."""
    value = holder.get("parameters")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(f"{field}: expected an object, got {json_type(value)}")
    return value


def claimed_rows(tensor: dict[str, Any]) -> int:
    """Rows a v2 tensor will be served as, before any data is read: text (BYTES) is flattened,
    so each element is a row ([1, N] is N rows); a numeric tensor's rows are its first dimension.
    """
    shape = tensor["shape"]
    if tensor["datatype"] == "BYTES":
        return math.prod(shape)
    return shape[0] if shape else 0


def _binary_tensor(binary: bytes, size: Any, datatype: str, shape: list[int]) -> Any:
    if not isinstance(size, int) or size < 0 or size > len(binary):
        raise bad("inputs[0].parameters.binary_data_size: does not match the binary data sent")
    raw = binary[:size]
    if datatype == "BYTES":
        items, offset = [], 0
        while offset < len(raw):
            if offset + 4 > len(raw):
                raise bad("inputs[0]: truncated BYTES element")
            (n,) = struct.unpack_from("<I", raw, offset)
            offset += 4
            items.append(raw[offset : offset + n].decode("utf-8", errors="replace"))
            offset += n
        return items
    dtype = NUMERIC_DATATYPES.get(datatype)
    if dtype is None:
        raise bad(f"inputs[0].datatype: {datatype!r} is not accepted")
    itemsize = np.dtype(dtype).itemsize
    if len(raw) != math.prod(shape) * itemsize:
        raise bad(
            f"inputs[0]: binary data has {len(raw)} bytes, shape {shape} of {datatype} needs {math.prod(shape) * itemsize}"
        )
    array = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise bad("inputs[0]: values must be finite numbers (no NaN or Infinity)")
    return array


def _binary_outputs(request: dict[str, Any]) -> set[str]:
    wanted: set[str] = set()
    if parameters(request, "parameters").get("binary_data_output"):
        wanted = {"label", "probabilities"}
    outputs = request.get("outputs")
    if outputs is None:
        return wanted
    if not isinstance(outputs, list):
        raise bad(f"outputs: expected a list of objects, got {json_type(outputs)}")
    for i, out in enumerate(outputs):
        if not isinstance(out, dict):
            raise bad(f"outputs[{i}]: expected an object, got {json_type(out)}")
        if parameters(out, f"outputs[{i}].parameters").get("binary_data"):
            wanted.add(str(out.get("name")))
    return wanted


def encode_v2(
    model: str,
    version: str,
    request_id: Any,
    labels: list[str],
    probabilities: np.ndarray,
    binary_outputs: set[str],
) -> tuple[bytes, dict[str, str]]:
    outputs: list[tuple[str, str, list[int], Any]] = [
        ("label", "BYTES", [len(labels)], labels),
        ("probabilities", "FP32", list(probabilities.shape), probabilities.astype(np.float32)),
    ]
    header: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": []}
    if request_id is not None:
        header["id"] = request_id
    blobs = []
    for name, datatype, shape, data in outputs:
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        if name in binary_outputs:
            blob = _encode_binary(datatype, data)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = data if datatype == "BYTES" else data.reshape(-1).tolist()
        header["outputs"].append(entry)
    head = json.dumps(header).encode()
    if not blobs:
        return head, {"content-type": "application/json"}
    return head + b"".join(blobs), {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(head)),
    }


def _encode_binary(datatype: str, data: Any) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in (s.encode() for s in data))
    return np.ascontiguousarray(data, dtype="<f4").tobytes()


# --- simple JSON (v1) ---------------------------------------------------------------------------


def decode_v1(body: bytes) -> list[Any]:
    request = parse_json(body)
    if not isinstance(request, dict) or "instances" not in request:
        raise bad("body: expected a JSON object with 'instances'")
    instances = request["instances"]
    if not isinstance(instances, list):
        raise bad("instances: expected a list (one instance per row)")
    if not instances:
        raise bad("instances: empty batch (no rows)")
    return instances


def v1_rows(instances: list[Any], kind: str, feature_columns: list[str], num_features: int) -> Any:
    if kind == "text":
        return text_rows(instances, "instances")
    if kind == "tabular" and all(isinstance(i, dict) for i in instances):
        # Named features: {"mean_radius": 14.1, ...}, in any order.
        rows = []
        for r, instance in enumerate(instances):
            missing = [c for c in feature_columns if c not in instance]
            extra = [c for c in instance if c not in feature_columns]
            if missing or extra:
                what = f"missing {missing[0]!r}" if missing else f"unknown feature {extra[0]!r}"
                raise bad(f"instances[{r}]: {what}")
            rows.append([instance[c] for c in feature_columns])
        instances = rows
    arrays = []
    for r, instance in enumerate(instances):
        if not isinstance(instance, list):
            raise bad(f"instances[{r}]: expected a list of {num_features} numbers")
        arrays.append(
            numeric_rows(instance, f"instances[{r}]", num_features, shape=None).reshape(-1)
        )
    return np.stack(arrays)
