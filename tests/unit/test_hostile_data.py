"""Hostile input without Ray: pictures, query lists, recall, index metadata, picture paths,
reserved columns and rows that could take a replica's memory, fool the gate or read outside
their place, each refused in one line naming what is wrong (tests/e2e/test_retrieval_serve.py
sends the same through real HTTP)."""

from __future__ import annotations

import base64
import io
import json
import os
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from app.config import DataConfig, ServeConfig, load_config
from app.data.kinds.image_text import BadPicture, PictureLimits, picture_size
from app.errors import ConfigError, GateError, UserError
from app.runtime.types import RequestError
from app.serve.http.protocol import read
from app.tasks.index.http.protocol import SearchBody
from app.tasks.retrieval.http.protocol import EmbeddingsRequest
from tests.unit.unit_helpers import prepared_rows

pytestmark = pytest.mark.unit


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


# --- item 1: pictures ---------------------------------------------------------------------------


def test_an_extreme_aspect_ratio_is_refused_from_its_header_before_any_pixel_is_decoded():
    sliver = png(4_194_304, 4)  # 16 Mpx within max_image_pixels; 234 Mpx after CLIP's resize
    assert len(sliver) < 100_000
    started = time.perf_counter()
    with pytest.raises(BadPicture, match=r"4194304x4 pixels, an aspect ratio of 1\.049e\+06, over"):
        picture_size(sliver, PictureLimits(max_pixels=2**25, max_aspect=20))
    assert time.perf_counter() - started < 0.5  # the header alone was read
    assert picture_size(png(400, 20), PictureLimits(max_aspect=20)) == (400, 20)  # 20:1 passes


def test_a_requests_pictures_together_are_bounded_before_any_is_decoded():
    from app.data.kinds.image_text import ImageText

    limits = PictureLimits(max_total_pixels=3 * 64 * 64, total_key="serve.max_request_pixels")
    pictures = [png(64, 64)] * 4
    with pytest.raises(BadPicture) as refused:
        ImageText.image_features(None, pictures, limits)  # type: ignore[arg-type]
    assert refused.value.status == 413
    assert str(refused.value) == (
        "4 pictures of 16384 pixels together, more than serve.max_request_pixels=12288"
    )


# --- item 2: search and embeddings request counts -------------------------------------------------


def refusal(body: dict, model: type, cfg: ServeConfig = ServeConfig()) -> RequestError:
    with pytest.raises(RequestError) as refused:
        read(json.dumps(body).encode(), model, cfg)
    return refused.value


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"queries": [{"text": "a"}] * 20_000},
            "queries: 20000 queries, more than serve.max_queries=256",
        ),
        (
            {"queries": [{"id": "x"}] * 200, "top_k": 100},
            "queries: 200 queries x top_k 100 = 20000 results, more than "
            "serve.max_search_results=10000",
        ),
        ({"query": {"text": "a"}, "top_k": 101}, "top_k: 101 is over serve.max_top_k=100"),
    ],
)
def test_search_over_a_limit_is_a_413_naming_it(body, message):
    refused = refusal(body, SearchBody)
    assert (refused.status, refused.message) == (413, message)


def test_the_query_count_is_checked_before_any_query_is_read():
    """20,000 queries, every one malformed: the count is what is refused (nothing was built)."""
    refused = refusal({"queries": [{"nope": 1}] * 20_000}, SearchBody)
    assert refused.status == 413 and "serve.max_queries" in refused.message


def test_fewer_rows_a_request_bound_the_queries_too():
    cfg = ServeConfig(max_request_rows=8)
    refused = refusal({"queries": [{"text": "a"}] * 9}, SearchBody, cfg)
    assert refused.message == "queries: 9 queries, more than serve.max_request_rows=8"


def test_more_embedding_inputs_than_a_request_may_carry_is_the_documented_413():
    refused = refusal({"model": "m", "input": ["a"] * 1025}, EmbeddingsRequest)
    assert refused.status == 413
    assert refused.message == "input: 1025 items, more than serve.max_request_rows=1024"


def test_the_replica_holds_to_the_caps_when_reached_without_the_route():
    from app.runtime.types import SearchQuery, SearchRequest
    from app.tasks.index.replica import within_caps

    many = SearchRequest((SearchQuery(id="x"),) * 300, 10)
    with pytest.raises(RequestError, match=r"queries: 300 is over serve.max_queries=256"):
        within_caps(many, ServeConfig())


@pytest.mark.parametrize(
    "vector, expected",
    [((1e20, 1e20), [0.7071068, 0.7071068]), ((1e-30, 0.0), [1.0, 0.0])],
)
def test_a_raw_query_of_any_scale_is_a_direction(vector, expected):
    from app.tasks.index.replica import unit_query

    assert unit_query(vector, 2, 0) == pytest.approx(np.asarray(expected), abs=1e-6)


# --- item 4: recall that a broken encoder cannot win ----------------------------------------------


def test_a_collapsed_encoder_scores_chance_and_a_nan_one_is_refused():
    from app.tasks.retrieval.train import NonFiniteEmbeddings, recall

    pictures, captions = 40, 2
    groups = np.repeat(np.arange(pictures), captions)
    constant = np.ones((pictures * captions, 8), np.float32)
    scores = recall(constant, constant, groups)
    assert scores["t2i_r1"] == pytest.approx(100 / pictures)  # was 100: ties counted as hits
    assert scores["t2i_r5"] == pytest.approx(500 / pictures)
    # i2t: a picture's 2 captions among 80 tied ones, within the first place: 2/80.
    assert scores["i2t_r1"] == pytest.approx(100 * captions / (pictures * captions))
    # Within the top k: one minus the chance that k draws from the 80 miss both captions.
    from math import comb

    i2t_r10 = 100 * (1 - comb(78, 10) / comb(80, 10))
    assert scores["i2t_r10"] == pytest.approx(i2t_r10)
    assert scores["rsum"] < 80  # chance, where it was 318
    nan = constant.copy()
    nan[3] = np.nan
    with pytest.raises(NonFiniteEmbeddings, match="1 of 80 image embeddings are not finite"):
        recall(nan, constant, groups)


def test_a_nan_cosine_fails_the_export_gate():
    from app.export.exporter import gate
    from app.tasks.retrieval.export import min_cosine, refusal

    torch_side = np.ones((4, 3), np.float32)
    onnx_side = torch_side.copy()
    onnx_side[1, 0] = np.nan
    assert min_cosine(torch_side, onnx_side) == -1.0
    report = {
        "parity": {"min_cosine": {"image": float("nan"), "text": 1.0}},
        "size_ratio_int8": 0.3,
        "recall_drop": {"i2t": 0.0, "t2i": 0.0},
        "recall_changes": {"i2t": {"lost": 0, "gained": 0}, "t2i": {"lost": 0, "gained": 0}},
    }
    with pytest.raises(GateError, match="image encoder's embeddings reach cosine nan"):
        gate(report, load_config(None, ["data.source=synthetic_image_text"]), refusal)


# --- item 5: an index that deploys ----------------------------------------------------------------


def predictions(folder, table: pa.Table, artifact: str = "registry/m/1") -> str:
    """A jobs.predict output of `table` written by hand (what jobs.index reads)."""
    from app.predict.write import PartWriter, PredictionManifest

    writer = PartWriter(str(folder), "", rows_per_file=1000, run="r")
    writer.write(table)
    shards = writer.close()
    PredictionManifest(
        created="now",
        artifact=artifact,
        model_name="m",
        model_version="1",
        variant="fp32",
        input="in.parquet",
        input_format="parquet",
        id_column="key",
        on_bad_rows="fail",
        rows={"input": table.num_rows, "output": table.num_rows, "rejected": 0},
        files=shards,
        rejects=[],
    ).write(str(folder / "manifest.json"))
    return str(folder)


def embedded(n: int, **metadata) -> pa.Table:
    vectors = np.eye(n, 4, dtype=np.float32) + 0.01
    columns = {
        "key": [f"k{i}" for i in range(n)],
        "embedding": pa.array(list(vectors), pa.list_(pa.float32())),
        **metadata,
    }
    return pa.table(columns)


def index_config(tmp_path, *overrides: str):
    return load_config(
        None,
        [
            "data.source=synthetic_image_text",
            f"export.registry={tmp_path / 'registry'}",
            *overrides,
        ],
    )


def test_a_passthrough_column_named_id_is_refused_at_index_time(tmp_path):
    from app.tasks.index.build import build_index

    uri = predictions(tmp_path / "p", embedded(3, id=["a", "b", "c"]))
    with pytest.raises(UserError, match=r"metadata column 'id': the name of each item's id"):
        build_index(index_config(tmp_path), uri)


def test_a_classifiers_predictions_are_refused_in_one_line(tmp_path):
    from app.tasks.index.build import build_index

    table = pa.table({"key": ["a"], "label": ["cat"], "probabilities": [[0.9, 0.1]]})
    uri = predictions(tmp_path / "p", table)
    with pytest.raises(UserError, match=r"hold no 'embedding' column .* a retrieval model's"):
        build_index(index_config(tmp_path), uri)


def test_binary_metadata_is_stored_base64_and_the_encoder_uri_absolute(tmp_path, monkeypatch):
    from app.runtime.vector_index import open_index
    from app.tasks.index.build import build_index

    monkeypatch.chdir(tmp_path)
    uri = predictions(tmp_path / "p", embedded(3, thumb=[b"\x89PNG\x00", b"", None]))
    built = build_index(index_config(tmp_path), uri)
    index = open_index(built["artifact"])
    assert index.items["thumb"].to_pylist() == [base64.b64encode(b"\x89PNG\x00").decode(), "", None]
    assert index.encoder["uri"] == str(tmp_path / "registry" / "m" / "1")


def test_an_items_metadata_over_its_bound_is_refused_naming_the_row(tmp_path):
    from app.tasks.index.build import build_index

    uri = predictions(tmp_path / "p", embedded(3, note=["short", "x" * 5000, "short"]))
    with pytest.raises(UserError, match=r"item 'k1' \(row 1\): 5010 bytes of metadata, more than"):
        build_index(index_config(tmp_path), uri)


# --- item 6: picture paths stay in their place -----------------------------------------------------


@pytest.fixture
def table_folder(tmp_path):
    data = tmp_path / "data"
    (data / "pics").mkdir(parents=True)
    (data / "pics" / "ok.png").write_bytes(png(8, 8))
    for i in range(GOOD):
        (data / "pics" / f"ok{i}.png").write_bytes(png(8 + i, 8))
    (tmp_path / "outside.png").write_bytes(png(8, 8))
    return data


GOOD = 8  # good pictures besides the one under test: a split by picture has train and val


def one_row_table(folder, image: str) -> DataConfig:
    images = [image, *(f"pics/ok{i}.png" for i in range(GOOD))]
    pd.DataFrame({"image": images, "caption": ["x"] * len(images)}).to_csv(
        folder / "pairs.csv", index=False
    )
    return DataConfig(source="image_text", path=str(folder / "pairs.csv"), val_fraction=0.5)


@pytest.mark.parametrize(
    "image",
    ["../outside.png", "{outside}", "/dev/zero", "missing.png", "pics", "pics/../../outside.png"],
    ids=["climbs out", "absolute", "device", "missing", "a folder", "normalised out"],
)
def test_a_picture_outside_its_place_and_a_missing_one_get_the_same_refusal(table_folder, image):
    image = image.format(outside=table_folder.parent / "outside.png")
    cfg = one_row_table(table_folder, image)
    with pytest.raises(UserError) as refused:
        prepared_rows(cfg, table_folder.parent / "out")
    assert f"pairs.csv row 0: image {image!r}: cannot read (missing, not a regular file" in str(
        refused.value
    )


def test_an_absolute_path_under_a_listed_root_is_read_and_big_files_are_bounded(table_folder):
    outside = str(table_folder.parent / "outside.png")
    cfg = one_row_table(table_folder, outside)
    allowed = cfg.model_copy(update={"image_roots": [str(table_folder.parent)]})
    assert len(prepared_rows(allowed, table_folder.parent / "out")[0]) == 1 + GOOD
    small = allowed.model_copy(update={"max_image_bytes": 1024})
    (table_folder.parent / "outside.png").write_bytes(png(8, 8) + b"\0" * 2000)
    with pytest.raises(UserError, match=r"row 0: image .*more than data.max_image_bytes=1024"):
        prepared_rows(small, table_folder.parent / "out")


def test_prepare_refuses_an_extreme_aspect_ratio_by_its_data_key(table_folder):
    (table_folder / "pics" / "sliver.png").write_bytes(png(2000, 10))
    cfg = one_row_table(table_folder, "pics/sliver.png")
    with pytest.raises(UserError, match=r"row 0: .*over data.max_image_aspect=20"):
        prepared_rows(cfg, table_folder.parent / "out")


# --- item 7: reserved columns and splits -----------------------------------------------------------


@pytest.mark.parametrize("column", ["image_id", "twin", "split"])
def test_a_metadata_column_named_as_the_products_own_is_refused(table_folder, column):
    frame = pd.DataFrame({"image": ["pics/ok.png"], "caption": ["x"], column: ["v"]})
    frame.to_csv(table_folder / "pairs.csv", index=False)
    with pytest.raises(UserError, match=f"column '{column}' is a name prepare writes itself"):
        cfg = DataConfig(source="image_text", path=str(table_folder / "pairs.csv"))
        prepared_rows(cfg, table_folder.parent / "out")


def test_an_unknown_karpathy_split_is_refused_naming_it_and_its_entry(table_folder):
    images = [
        {"filename": "pics/ok.png", "split": "train", "sentences": [{"raw": "a"}]},
        {"filename": "pics/ok.png", "split": "validation", "sentences": [{"raw": "b"}]},
    ]
    (table_folder / "dataset.json").write_text(json.dumps({"images": images}))
    cfg = DataConfig(
        source="image_text", format="karpathy", path=str(table_folder / "dataset.json")
    )
    with pytest.raises(UserError, match=r"images\[1\]: split 'validation' is none of train, "):
        prepared_rows(cfg, table_folder.parent / "out")


# --- item 8: a folder's chat template is checked when the folder is read -------------------------


def test_a_chat_template_with_a_syntax_error_fails_prepare_with_exit_2(tmp_path):
    from app.pipeline.stages import prepare
    from tools.make_tiny_pretrained import MAKERS

    folder = MAKERS["gpt2"](str(tmp_path / "gpt2"))
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}{{ m.content }")
    config = load_config(
        None,
        [
            "data.source=synthetic_text",
            f"model.pretrained={folder}",
            f"data.output={tmp_path / 'data'}",
            "train.task=lm",
        ],
    )
    with pytest.raises(ConfigError, match=r"chat_template.jinja: "):
        prepare(config)
    assert not (tmp_path / "data").exists()  # refused before anything was written


# --- item 9 and the low ones ----------------------------------------------------------------------


def test_whole_floats_in_integer_sampling_columns_are_read_as_integers():
    from app.tasks.lm.predict import Settings, sampling_params

    settings = Settings.of(load_config(None, ["data.source=synthetic_text"]))
    params = sampling_params({"max_tokens": 8.0, "seed": float("nan")}, settings, ServeConfig())
    assert (params.max_tokens, params.seed) == (8, None)
    with pytest.raises(RequestError, match=r"^max_tokens: "):
        sampling_params({"max_tokens": 8.5}, settings, ServeConfig())


def test_a_json_line_with_an_unknown_sampling_field_is_refused():
    from app.predict.actor import PredictInput
    from app.predict.row_checks import json_line_columns
    from app.tasks.lm.predict import CompletionPredictor

    config = load_config(None, ["data.source=synthetic_text"])
    spec = CompletionPredictor.input_spec(
        PredictInput({"kind": "tokens"}, "id", "jsonl", [], config, "in")
    )
    lines = [b'{"id": 1, "prompt": "a", "temprature": 0.5}', b'{"id": 2, "prompt": "b"}']
    _, problems, _ = json_line_columns(lines, [1, 2], ["in.jsonl"] * 2, spec)
    assert problems[0] is not None and problems[0].startswith('line: unknown field "temprature"')
    assert problems[1] is None


def test_overrides_may_follow_the_options():
    from app.cli import parser

    p = parser("export", "x")
    p.add_argument("--checkpoint")
    args = p.parse_args(["--config", "C", "--checkpoint", "X", "export.registry=R", "a.b=1"])
    assert (args.checkpoint, args.overrides) == ("X", ["export.registry=R", "a.b=1"])


def test_the_readme_index_command_names_its_config():
    from tests.conftest import REPO

    readme = (REPO / "README.md").read_text()
    assert "jobs.index --embeddings" not in readme
    assert "jobs.index --config C --embeddings DIR" in readme


def test_picture_limits_of_the_data_keep_their_pixel_limit():
    limits = PictureLimits(max_pixels=10**6)
    with pytest.raises(BadPicture) as refused:
        limits.check(2000, 2000)
    assert refused.value.status == 413


def test_a_message_over_the_transports_limit_is_a_413_not_a_retryable_503():
    from grpc import StatusCode
    from grpc.aio import AioRpcError, Metadata

    from app.serve.http.clients import too_large_for_transport

    def error(code: StatusCode) -> AioRpcError:
        return AioRpcError(code, Metadata(), Metadata(), "details")

    assert too_large_for_transport(error(StatusCode.RESOURCE_EXHAUSTED))
    assert not too_large_for_transport(error(StatusCode.UNAVAILABLE))
    assert not too_large_for_transport(RuntimeError("a replica died"))


def test_thumbnails_are_stored_apart_from_the_metadata_in_index_order(tmp_path):
    from app.runtime.vector_index import open_index
    from app.tasks.index.build import build_index

    jpegs = [b"\xff\xd8one", None, b"\xff\xd8three"]
    uri = predictions(tmp_path / "p", embedded(3, caption=["a", "b", "c"], thumbnail=jpegs))
    index = open_index(
        build_index(index_config(tmp_path, "index.thumbnails=true"), uri)["artifact"]
    )
    assert index.thumbnails is not None and index.thumbnails.to_pylist() == jpegs
    assert index.items.column_names == ["id", "caption"]  # never metadata, never base64
    without = build_index(index_config(tmp_path), uri)  # not asked for: not kept
    assert open_index(without["artifact"]).thumbnails is None


def test_a_thumbnail_is_a_small_jpeg_or_none_over_its_cap():
    import io

    from PIL import Image

    from app.tasks.retrieval.predict import Thumbnails

    picture = np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)
    data = Thumbnails(px=128, max_bytes=16384).of(picture)
    assert data is not None and len(data) <= 16384
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "JPEG" and image.size == (128, 96)
    assert Thumbnails(px=128, max_bytes=1024).of(picture) is None  # noise does not compress
