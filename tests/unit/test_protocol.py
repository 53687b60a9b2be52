"""The HTTP contract's pure parts: parsing, validation and encoding (no Ray, no network)."""

from __future__ import annotations

import asyncio
import json
import struct

import numpy as np
import pytest

from app.runtime.rows import MAX_DIM, claimed_rows, instance_rows, numeric_rows, text_rows
from app.runtime.types import InferResult, RequestError
from app.serve.http.gate import check_content_type, parse_json
from app.serve.http.routes.v1 import decode_v1
from app.serve.http.routes.v2 import decode_v2, encode_v2

TABULAR = {
    "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 2]}],
    "feature_columns": ["a", "b"],
}
TEXT = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}], "feature_columns": ["t"]}

pytestmark = pytest.mark.unit


def error_of(fn, *args, **kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn(*args, **kw)
    return info.value


@pytest.mark.parametrize(
    "body,fragment",
    [
        (b"", "empty"),
        (b"{x", "not valid JSON"),
        (b"[" * 10000 + b"]" * 10000, "nested too deeply"),
        (b'{"a": NaN}', "NaN"),
        (b'{"a": Infinity}', "Infinity"),
        (b"\xff\xfe", "JSON"),
    ],
)
def test_parse_json_refuses_with_400(body, fragment):
    err = error_of(parse_json, body)
    assert err.status == 400 and fragment in err.message


def test_content_types():
    check_content_type(None, binary=False)
    check_content_type("application/json; charset=utf-8", binary=False)
    check_content_type("application/octet-stream", binary=True)
    assert error_of(check_content_type, "text/plain", binary=False).status == 415
    assert error_of(check_content_type, "application/octet-stream", binary=False).status == 415


def test_numeric_rows_accepts_flat_and_nested_shapes():
    flat = numeric_rows(list(range(8)), "x", 4, "FP32", [2, 4])
    nested = numeric_rows([[0, 1, 2, 3], [4, 5, 6, 7]], "x", 4, "INT64", [2, 4])
    images = numeric_rows(np.zeros(2 * 8 * 8).tolist(), "x", 64, "FP64", [2, 8, 8])
    assert flat.dtype == np.float32 and np.array_equal(flat, nested) and images.shape == (2, 64)


@pytest.mark.parametrize(
    "data,datatype,shape,fragment",
    [
        ([1, 2, 3], "FP32", [1, 3], "needs 4 values"),
        (["1", "2", "3", "4"], "FP32", [1, 4], "numbers"),
        ([True, False, True, False], "FP32", [1, 4], "numbers"),
        ([None, 1, 2, 3], "FP32", [1, 4], "numbers"),
        ([1, 2, 3, 4], "BYTES", [1, 4], "datatype"),
        ([1, 2, 3, 4], "FP32", [1, 5], "each row needs 4 values, got 5"),
        ([1, 2, 3, 4], "FP32", [1, 2, 3], "each row needs 4 values, got 6"),
        ([], "FP32", [0, 4], "empty batch"),
        ([1e308 * 10, 1, 2, 3], "FP32", [1, 4], "finite"),
        ([[1, 2], [3]], "FP32", None, "different lengths"),
        ([1, 2, 3, 4], "FP32", [4], "expected [rows, 4]"),
    ],
)
def test_numeric_rows_refusals_name_the_problem(data, datatype, shape, fragment):
    err = error_of(numeric_rows, data, "inputs[0]", 4, datatype, shape)
    assert err.status == 400 and fragment in err.message


def test_text_rows():
    assert text_rows([["a"], ["b"]], "t") == ["a", "b"]
    assert "expected a string" in error_of(text_rows, ["a", 3], "t").message
    assert "empty batch" in error_of(text_rows, [], "t").message


@pytest.mark.parametrize(
    "data,fragment",
    [
        ("abc", "t: expected a list of strings, got string"),  # not one row per character
        (7, "t: expected a list of strings, got number"),
        (None, "t: expected a list of strings, got null"),
        (["ok", None], "t[1]: expected a string, got null"),
        (["ok", "fine", "bad \ud800 text"], "t[2]: not valid Unicode text"),
    ],
)
def test_text_rows_refuse_non_lists_and_lone_surrogates(data, fragment):
    err = error_of(text_rows, data, "t")
    assert err.status == 400 and fragment in err.message


def test_text_rows_are_counted_after_flattening():
    # A text tensor of shape [1, N] is N rows: the row limit must see N, not 1.
    assert len(text_rows([["x"] * 5000], "t")) == 5000
    assert claimed_rows("BYTES", [1, 5000]) == 5000
    assert claimed_rows("FP32", [3, 64]) == 3


def test_v2_binary_extension_round_trip():
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "datatype": "FP32",
                    "shape": [2, 4],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "label", "parameters": {"binary_data": True}}],
        }
    ).encode()
    parsed = decode_v2(header + x.tobytes(), str(len(header)), 1024)
    assert np.array_equal(np.asarray(parsed.request.tensor.data).reshape(2, 4), x)
    assert parsed.binary_outputs == {"label"}
    result = InferResult(["a", "bc"], np.ones((2, 2), np.float32), "3", ["a", "bc"], 1)
    body, headers = encode_v2("m", "req-1", result, frozenset({"label"}))
    n = int(headers["inference-header-content-length"])
    head = json.loads(body[:n])
    assert head["model_version"] == "3" and head["id"] == "req-1"
    blob = body[n:]
    assert struct.unpack_from("<I", blob, 0)[0] == 1 and blob[4:5] == b"a" and blob[9:11] == b"bc"
    assert head["outputs"][1]["data"] == [1.0, 1.0, 1.0, 1.0]


def test_v2_binary_bytes_input_and_bad_lengths():
    blob = struct.pack("<I", 2) + b"hi" + struct.pack("<I", 3) + b"you"
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [2],
                    "parameters": {"binary_data_size": len(blob)},
                }
            ]
        }
    ).encode()
    assert decode_v2(header + blob, str(len(header)), 1024).request.tensor.data == [b"hi", b"you"]
    assert "outside the body" in error_of(decode_v2, header, str(len(header) + 5), 1024).message
    short = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1, 4],
                    "parameters": {"binary_data_size": 8},
                }
            ]
        }
    ).encode()
    assert "needs 16" in error_of(decode_v2, short + b"\0" * 8, str(len(short)), 1024).message


@pytest.mark.parametrize(
    "request_json,fragment",
    [
        ({}, "inputs"),
        ({"inputs": []}, "inputs"),
        ({"inputs": [1]}, "inputs[0]"),
        ({"inputs": [{"name": "x", "datatype": "FP32"}]}, "shape"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2], "data": []}]}, "shape"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2]}]}, "data"),
        ([1], "object"),
    ],
)
def test_v2_structure_errors(request_json, fragment):
    err = error_of(decode_v2, json.dumps(request_json).encode(), None, 1024)
    assert err.status == 400 and fragment in err.message


def _tensor(**extra):
    return {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2], **extra}


@pytest.mark.parametrize(
    "request_json,fragment",
    [
        ({"inputs": [_tensor()], "parameters": [1]}, "parameters: expected an object, got list"),
        ({"inputs": [_tensor()], "parameters": "x"}, "parameters: expected an object, got string"),
        ({"inputs": [_tensor(parameters=3)]}, "inputs[0].parameters: expected an object"),
        ({"inputs": [_tensor()], "outputs": 3}, "outputs: expected a list of objects, got number"),
        ({"inputs": [_tensor()], "outputs": {"name": "label"}}, "outputs: expected a list"),
        ({"inputs": [_tensor()], "outputs": ["label"]}, "outputs[0]: expected an object"),
        (
            {"inputs": [_tensor()], "outputs": [{"name": "label", "parameters": 5}]},
            "outputs[0].parameters: expected an object, got number",
        ),
        ({"inputs": [_tensor(data="abc")]}, "inputs[0].data: expected a list, got string"),
        ({"inputs": [_tensor(data=5)]}, "inputs[0].data: expected a list, got number"),
        ({"inputs": [_tensor(data=None)]}, "inputs[0].data: expected a list, got null"),
        ({"inputs": [_tensor(name=5)]}, "inputs[0].name: expected a string"),
    ],
)
def test_v2_fields_of_the_wrong_json_type_are_400s_naming_the_field(request_json, fragment):
    err = error_of(decode_v2, json.dumps(request_json).encode(), None, 1024)
    assert err.status == 400 and fragment in err.message


def test_v2_null_parameters_and_outputs_read_as_absent():
    body = {"inputs": [_tensor(parameters=None)], "parameters": None, "outputs": None}
    assert decode_v2(json.dumps(body).encode(), None, 1024).binary_outputs == set()


def test_v1_rows_for_each_kind():
    assert decode_v1(b'{"instances": [[1, 2]]}', 10) == [[1, 2]]
    assert "empty batch" in error_of(decode_v1, b'{"instances": []}', 10).message
    assert error_of(decode_v1, b'{"instances": [[1, 2], [3, 4]]}', 1).status == 413
    assert instance_rows(["a b"], TEXT) == ["a b"]
    named = instance_rows([{"b": 2, "a": 1}], TABULAR)
    assert named.tolist() == [[1.0, 2.0]]
    assert (
        "unknown feature 'c'"
        in error_of(instance_rows, [{"a": 1, "b": 2, "c": 3}], TABULAR).message
    )
    assert "instances[1]" in error_of(instance_rows, [[1, 2], [1]], TABULAR).message


# --- a request's cost is bounded before any work proportional to what it claims ------------------


class CountingList(list):
    """A shape that counts how many of its dims were looked at."""

    seen = 0

    def __iter__(self):
        for d in super().__iter__():
            CountingList.seen += 1
            yield d


def test_a_shape_product_stops_at_the_first_dim_past_its_limit():
    from app.runtime.rows import bounded_product

    CountingList.seen = 0
    dims = CountingList([1, 999_999_999, *([999_999_999] * 100_000)])
    with pytest.raises(RequestError):
        bounded_product(dims, 1024, "inputs[0].shape")
    assert CountingList.seen == 2


def test_huge_claimed_dims_are_refused_without_multiplying_them_out():
    shape = [1] + [999_999_999] * 30_000  # a 0.3 MB body
    numeric = {"inputs": [{"name": "features", "datatype": "FP32", "shape": shape, "data": [1]}]}
    parsed = decode_v2(json.dumps(numeric).encode(), None, 1024)
    err = error_of(
        numeric_rows,
        parsed.request.tensor.data,
        "inputs[0]",
        2,
        "FP32",
        parsed.request.tensor.shape,
    )
    assert err.status == 400 and "inputs[0].shape: holds more than" in err.message
    text = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": shape, "data": ["a"]}]}
    err = error_of(decode_v2, json.dumps(text).encode(), None, 1024)
    assert err.status == 413


DIGITS_INPUTS = [{"name": "image", "datatype": "FP32", "shape": [-1, 64]}]
BAD_BODIES = {
    # 2 million numbers under a huge claimed shape (80 ms to parse)
    "huge-shape": b'{"inputs": [{"name": "image", "datatype": "FP32", "shape": [999999999, 64], '
    + b'"data": ['
    + b",".join([b"0"] * 2_000_000)
    + b"]}]}",
    # a million empty rows (380 ms to parse, 86 MiB of Python objects)
    "empty-rows": b'{"instances": [' + b",".join([b"[]"] * 1_000_000) + b"]}",
    "tiny-strings": b'{"instances": [' + b",".join([b'"a"'] * 1_000_000) + b"]}",
}


def arrive(body: bytes, inputs: list[dict], chunk: int = 65536) -> int:
    """Feeds `body` in chunks to the body reader of every route, for a model taking `inputs`;
    the bytes that had arrived when it refused."""
    from types import SimpleNamespace

    from app.config import ServeConfig
    from app.serve.http.gate import body as read_body
    from app.serve.http.gate import max_json_items

    arrived = 0

    async def stream():
        nonlocal arrived
        for start in range(0, len(body), chunk):
            arrived = min(start + chunk, len(body))
            yield body[start : start + chunk]

    cfg = ServeConfig(max_body_bytes=1 << 30)
    request = SimpleNamespace(
        headers={}, app=SimpleNamespace(state=SimpleNamespace(config=cfg)), stream=stream
    )
    max_items = max_json_items(inputs, cfg.max_request_rows)
    try:
        asyncio.run(read_body(request, inputs=inputs))  # type: ignore[arg-type]
    except RequestError as e:
        assert e.status == 413 and f"holds more than {max_items} JSON values" in e.message
    return arrived


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_a_body_holding_more_values_than_the_models_rows_can_is_refused_as_it_arrives(name):

    body = BAD_BODIES[name]
    assert arrive(body, DIGITS_INPUTS) < len(body) / 4  # refused with most of it still to come


def well_formed_bodies() -> list[bytes]:
    one_array_a_value = {
        "inputs": [
            {
                "name": "image",
                "datatype": "FP32",
                "shape": [1024, 64],
                "data": [[[float(v)] for v in range(64)] for _ in range(1024)],
                "parameters": {"note": "a, b, [c], {d}"},
            }
        ],
        "outputs": [{"name": "label"}, {"name": "probabilities"}],
    }
    named = {"instances": [{f"c{i}": 1.0 for i in range(64)} for _ in range(1024)]}
    # Commas and brackets inside strings are text, not values, even cut short mid-string.
    texts = {"instances": ['say "a, b", [c] {d} \\' * 400] * 1024}
    return [json.dumps(body).encode() for body in (one_array_a_value, named, texts)]


@pytest.mark.parametrize("chunk", [65536, 7, 1 << 30])
def test_the_largest_well_formed_bodies_pass_the_item_bound_however_they_arrive(chunk):
    from app.serve.http.gate import max_json_items

    bodies = well_formed_bodies()
    for body, inputs in zip(bodies, [DIGITS_INPUTS, DIGITS_INPUTS, TEXT["inputs"]], strict=True):
        if chunk == 7 and len(body) > 2**20:
            body = body[: 2**20]  # seven bytes at a time: the first MiB is enough
        assert arrive(body, inputs, chunk) == len(body)
    # A row of no fixed size (a language model's tokens) is not bounded this way.
    assert max_json_items([{"name": "t", "datatype": "INT64", "shape": [-1, -1]}], 1024) is None


def test_dims_too_large_to_print_are_a_400_naming_the_dim():
    body = (
        b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1'
        + b"0" * 4299
        + b'], "data": [1]}]}'
    )
    err = error_of(decode_v2, body, None, 1024)
    assert err.status == 400 and err.message == f"inputs[0].shape[1]: too large (at most {MAX_DIM})"


def bytes_request(blob: bytes, shape: list[int]) -> tuple[bytes, str]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": shape,
                    "parameters": {"binary_data_size": len(blob)},
                }
            ]
        }
    ).encode()
    return header + blob, str(len(header))


def test_a_bytes_length_prefix_past_the_data_is_a_400_not_a_cut_string():
    blob = struct.pack("<I", 2) + b"hi" + struct.pack("<I", 50) + b"only nine"
    err = error_of(decode_v2, *bytes_request(blob, [2]), 1024)
    assert err.status == 400 and "BYTES element 1 claims 50 bytes, 9 are left" in err.message


def test_invalid_utf8_in_a_bytes_element_is_a_400_naming_it():
    blob = struct.pack("<I", 2) + b"ok" + struct.pack("<I", 3) + b"a\xffb"
    parsed = decode_v2(*bytes_request(blob, [2]), 1024)
    err = error_of(text_rows, parsed.request.tensor.data, "inputs[0].data")
    assert err.status == 400 and err.message == "inputs[0].data[1]: not valid UTF-8 (byte 1)"
