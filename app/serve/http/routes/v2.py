"""Open Inference Protocol v2: server and model metadata, health, and inference, and its wire
format (JSON and the binary tensor extension: `decode_v2` into a typed request, `encode_v2` of
an `InferResult`), without Ray.

A v2 inference, end to end: `Gate` (app/serve/http/gate.py) -> `infer` -> `body` (gate) ->
`decode_v2` -> `Models.infer` (clients) -> `ClassifierServer.infer` (the replica: row checks,
preprocess, batch, ONNX Runtime) -> `encode_v2`.

Every problem with a request is a `RequestError` naming the field; nothing here raises anything
else on bad input. Work is bounded by what was checked before it: a shape's dims are checked
one by one (a product stops as soon as it passes its limit), so a body claiming huge dims costs
no more than a well-formed one.
"""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from app import __version__
from app.data.checks import json_type
from app.runtime.rows import (
    MAX_DIM,
    NUMERIC_DATATYPES,
    bounded_product,
    claimed_rows,
    too_many_rows,
)
from app.runtime.types import (
    InferRequest,
    InferResult,
    ModelInfo,
    RequestError,
    Tensor,
    bad,
)
from app.serve.http.clients import INFO_FRESH_S, Models
from app.serve.http.gate import body, error, parse_json
from app.serve.http.routes.common import models

router = APIRouter()


@router.get("/v2")
async def server_metadata():
    return {"name": "raytorch", "version": __version__, "extensions": ["binary_tensor_data"]}


@router.get("/v2/health/live")
async def live():
    return {"live": True}


@router.get("/v2/health/ready")
async def ready(request: Request):
    """Answered from what the models said at most INFO_FRESH_S ago: the probe is public, so it
    must not put a call into every replica's queue per request."""
    m = models(request)
    try:
        await asyncio.gather(*(m.info(name, INFO_FRESH_S) for name in m.clients))
    except Exception as e:  # noqa: BLE001 - not ready is an answer, not a crash
        return error(503, f"not ready: {type(e).__name__}")
    return {"ready": True}


@router.get("/v2/models/{name}")
@router.get("/v2/models/{name}/versions/{version}")
async def model_metadata(name: str, request: Request, version: str | None = None):
    info = await live_version(models(request), name, version, fresh_within_s=0.0)
    parameters: dict[str, Any] = {"labels": info.labels, "variant": info.variant}
    if info.generation is not None:
        parameters["generation"] = info.generation
    return {
        "name": name,
        "versions": [info.version],
        "platform": "onnxruntime_onnx",
        "inputs": info.inputs,
        "outputs": info.outputs,
        "parameters": parameters,
    }


@router.get("/v2/models/{name}/ready")
@router.get("/v2/models/{name}/versions/{version}/ready")
async def model_ready(name: str, request: Request, version: str | None = None):
    await live_version(models(request), name, version, fresh_within_s=0.0)
    return {"name": name, "ready": True}


@router.post("/v2/models/{name}/infer")
async def infer_live(name: str, request: Request):
    return await infer(name, request)


@router.post("/v2/models/{name}/versions/{version}/infer")
async def infer_version(name: str, version: str, request: Request):
    return await infer(name, request, version)


async def infer(name: str, request: Request, version: str | None = None) -> Response:
    """Both infer routes (a separate route each: with an optional `version` parameter, FastAPI
    would read it from the query string of every unversioned request)."""
    m: Models = request.app.state.models
    info = await m.info(name, INFO_FRESH_S)  # its schema bounds what is parsed
    if version is not None and version != info.version:  # a 404 before any model runs
        raise not_deployed(name, version, info.version)
    header_length = request.headers.get(BINARY_HEADER)
    raw = await body(request, binary=header_length is not None, inputs=info.inputs)
    parsed = decode_v2(raw, header_length, m.max_request_rows)
    result = await m.infer(name, parsed.request)
    if version is not None and version != result.version:  # redeployed meanwhile
        raise not_deployed(name, version, result.version)
    content, headers = encode_v2(name, parsed.id, result, parsed.binary_outputs)
    headers["x-model-replica"] = str(result.replica_pid)
    return Response(content=content, headers=headers)


async def live_version(
    m: Models, name: str, version: str | None, fresh_within_s: float
) -> ModelInfo:
    info = await m.info(name, fresh_within_s)
    if version is not None and version != info.version:
        raise not_deployed(name, version, info.version)
    return info


def not_deployed(name: str, version: str, live: str) -> RequestError:
    return RequestError(404, f"model {name!r} version {version!r} is not deployed (live: {live})")


# --- the wire format ---------------------------------------------------------------------------

BINARY_HEADER = "inference-header-content-length"


@dataclass(frozen=True, slots=True)
class V2Request:
    id: Any
    request: InferRequest
    binary_outputs: frozenset[str]


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
