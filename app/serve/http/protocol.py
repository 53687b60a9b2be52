"""The wire formats of the Open Inference Protocol v2 and the simple JSON API: request decoding
into typed requests (app/runtime/types.py) and answer encoding, without Ray or FastAPI.

Every problem with a request is a `RequestError` carrying the HTTP status and a message naming the
field; nothing here raises anything else on bad input. Work is bounded by what was checked
before it: a shape's dims are checked one by one (a product stops as soon as it passes its
limit), so a body claiming huge dims costs no more than a well-formed one.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.data.checks import json_type
from app.runtime.rows import (
    MAX_DIM,
    NUMERIC_DATATYPES,
    bounded_product,
    claimed_rows,
    too_many_rows,
)
from app.runtime.types import InferRequest, InferResult, Tensor, bad

BINARY_HEADER = "inference-header-content-length"


@dataclass(frozen=True, slots=True)
class V2Request:
    id: Any
    request: InferRequest
    binary_outputs: frozenset[str]


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


# --- bounding a JSON body before it is parsed ---------------------------------------------------
# Parsing costs what a body holds, not what its rows need (2 million numbers take 80 ms, a
# million empty lists 380 ms and 86 MiB): a body is refused while it arrives, once what has
# arrived holds more items than the model's rows could.

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
ENVELOPE_ITEMS = 1024  # the request object, its parameters and outputs, around the rows

Text = bytes | bytearray


def json_items(text: Text) -> int:
    """Commas and opening brackets: at least the number of values and members a JSON text
    holds (those inside strings included), counted at memory speed without parsing."""
    return text.count(b",") + text.count(b"[") + text.count(b"{")


def max_json_items(inputs: list[dict[str, Any]], max_rows: int) -> int | None:
    """The most items a body of `max_rows` rows of this input can hold: each of a row's values
    may come in an array of its own, each row in one more (None: a row's size is not fixed)."""
    dims = inputs[0]["shape"][1:] if inputs else [-1]
    if any(d < 0 for d in dims):
        return None
    return max_rows * (2 * math.prod(dims) + 2) + ENVELOPE_ITEMS


def holds_more_items(text: Text, max_items: int) -> bool:
    """Whether a JSON body, or the part of it that has arrived, holds more than `max_items`."""
    items = json_items(text)
    if items <= max_items:  # the common case: one pass, no copy
        return False
    # A string is at least half an item (a key and its value): many strings alone are enough.
    quotes = text.count(b'"')
    if quotes > 4 * max_items + 2 and (quotes - text.count(b'\\"')) // 4 > max_items + 1:
        return True
    end = 0
    for string in _STRING.finditer(text):  # commas and brackets inside strings do not count
        items, end = items - json_items(string.group()), string.end()
        if items <= max_items:
            return False
    still_arriving = text.find(b'"', end)  # a string the part that has arrived cuts short
    if still_arriving >= 0:
        items -= json_items(text[still_arriving:])
    return items > max_items


@dataclass(slots=True)
class ItemGuard:
    """A JSON body's items counted as its chunks arrive (`routes/common.body` adds each chunk's
    `json_items`): once the raw count passes `max_items` (and each time it doubles after that)
    `check` makes the exact count, strings set apart, and refuses the body (413) as soon as
    what has arrived holds more than `max_items`."""

    max_items: int
    items: int = 0  # commas and brackets so far, those inside strings included
    checked: int = 0  # the raw count at the last exact count

    def check(self, received: Text) -> None:
        if holds_more_items(received, self.max_items):
            raise bad(f"body: holds more than {self.max_items} JSON values for this model", 413)
        self.checked = self.items


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


def decode_v2(body: bytes, header_length: str | None, max_rows: int) -> V2Request:
    json_part, binary = (body, b"") if header_length is None else split_binary(body, header_length)
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
    for key in ("name", "datatype"):
        if not isinstance(tensor[key], str):
            raise bad(f"inputs[0].{key}: expected a string, got {json_type(tensor[key])}")
    shape = check_shape(tensor["shape"], "inputs[0].shape")
    numeric = tensor["datatype"] != "BYTES" and shape
    rows = shape[0] if numeric else claimed_rows(tensor["datatype"], shape)
    if rows > max_rows:  # before any data is read
        raise too_many_rows(rows, max_rows)
    size = None
    if tensor.get("parameters") is not None:
        size = parameters(tensor, "inputs[0].parameters").get("binary_data_size")
    if size is not None:
        data = _binary_tensor(binary, size, tensor["datatype"], shape)
    elif "data" not in tensor:
        raise bad("inputs[0].data: missing")
    elif not isinstance(tensor["data"], list):
        # A string would be read as one row per character, a number or null not at all.
        raise bad(f"inputs[0].data: expected a list, got {json_type(tensor['data'])}")
    else:
        data = tensor["data"]
    return V2Request(
        id=request.get("id"),
        request=InferRequest(tensor=Tensor(tensor["name"], tensor["datatype"], shape, data)),
        binary_outputs=frozenset(
            _binary_outputs(request) if "outputs" in request or "parameters" in request else ()
        ),
    )


def check_shape(shape: Any, field: str) -> list[int]:
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise bad(f"{field}: expected a list of non-negative integers")
    for i, d in enumerate(shape):
        if d > MAX_DIM:  # never printed: a dim of 4300 digits cannot be formatted
            raise bad(f"{field}[{i}]: too large (at most {MAX_DIM})")
    return shape


def parameters(holder: dict[str, Any], field: str) -> dict[str, Any]:
    """The optional `parameters` object of a request, input or output (null reads as absent)."""
    value = holder.get("parameters")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(f"{field}: expected an object, got {json_type(value)}")
    return value


def _binary_tensor(binary: bytes, size: Any, datatype: str, shape: list[int]) -> Any:
    if not isinstance(size, int) or size < 0 or size > len(binary):
        raise bad("inputs[0].parameters.binary_data_size: does not match the binary data sent")
    raw = binary[:size]
    if datatype == "BYTES":
        return _bytes_elements(raw)
    dtype = NUMERIC_DATATYPES.get(datatype)
    if dtype is None:
        raise bad(f"inputs[0].datatype: {datatype!r} is not accepted")
    itemsize = np.dtype(dtype).itemsize
    needed = bounded_product(shape, MAX_DIM, "inputs[0].shape") * itemsize
    if len(raw) != needed:
        raise bad(
            f"inputs[0]: binary data has {len(raw)} bytes, shape {shape} of {datatype} needs {needed}"
        )
    array = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise bad("inputs[0]: values must be finite numbers (no NaN or Infinity)")
    return array


def _bytes_elements(raw: bytes) -> list[bytes]:
    """BYTES elements, each a 4-byte little-endian length and that many bytes; a length that
    runs past the data is refused, not cut short. Decoded (strictly) with the other rows."""
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise bad(f"inputs[0]: BYTES element {len(items)} is truncated (no length)")
        (n,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + n > len(raw):
            raise bad(
                f"inputs[0]: BYTES element {len(items)} claims {n} bytes, "
                f"{len(raw) - offset} are left"
            )
        items.append(raw[offset : offset + n])
        offset += n
    return items


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
    model: str, request_id: Any, result: InferResult, binary_outputs: frozenset[str]
) -> tuple[bytes, dict[str, str]]:
    labels, probabilities = result.labels, result.probabilities
    outputs: list[tuple[str, str, list[int], Any]] = [
        ("label", "BYTES", [len(labels)], labels),
        ("probabilities", "FP32", list(probabilities.shape), probabilities.astype(np.float32)),
    ]
    header: dict[str, Any] = {"model_name": model, "model_version": result.version, "outputs": []}
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


def decode_v1(body: bytes, max_rows: int) -> list[Any]:
    request = parse_json(body)
    if not isinstance(request, dict) or "instances" not in request:
        raise bad("body: expected a JSON object with 'instances'")
    instances = request["instances"]
    if not isinstance(instances, list):
        raise bad("instances: expected a list (one instance per row)")
    if not instances:
        raise bad("instances: empty batch (no rows)")
    if len(instances) > max_rows:
        raise too_many_rows(len(instances), max_rows)
    return instances
