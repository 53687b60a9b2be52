"""Batch inference without Ray: column matching, row checks, the output's parts and manifest."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.errors import UserError
from app.predict.actor import outputs_table, split_predictions
from app.predict.read import check_columns, input_files
from app.predict.row_checks import MISSING, InputSpec, check_batch, json_line_columns
from app.predict.write import (
    PartWriter,
    PredictionManifest,
    check_output,
    commit,
    verify_output,
)
from app.tasks.classify.predict import classifier_outputs

pytestmark = pytest.mark.unit

TABULAR = {
    "kind": "tabular",
    "feature_columns": ["a", "b"],
    "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 2]}],
}
TEXT = {
    "kind": "text",
    "feature_columns": ["text"],
    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
}
IMAGE = {
    "kind": "image",
    "feature_columns": ["image"],
    "inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 4]}],
}


def tabular(fmt: str = "parquet") -> InputSpec:
    return InputSpec.of(TABULAR, "id", fmt)


def test_spec_matches_the_artifacts_columns_by_name():
    spec = tabular()
    assert spec.columns == ["id", "a", "b"] and spec.num_features == 2
    assert InputSpec.of(TEXT, "key").columns == ["key", "text"]
    with pytest.raises(UserError, match="--id-column 'a' is one of the model's feature columns"):
        InputSpec.of(TABULAR, "a")


def test_typed_columns_take_the_fast_path_and_name_each_bad_row():
    columns = {
        "id": pa.array([1, 2, 3, 4, 5]),
        "a": pa.array([1.0, None, 3.0, float("nan"), 5.0]),
        "b": pa.array([10, 20, 30, 40, None], pa.int32()),  # ints are numbers too
    }
    checked = check_batch(columns, 5, tabular())
    assert checked.reasons == [
        None,
        "column 'a': null",
        None,
        "column 'a': not a finite number (nan)",
        "column 'b': null",
    ]
    assert checked.good.tolist() == [0, 2]
    np.testing.assert_array_equal(checked.raw, np.asarray([[1, 10], [3, 30]], np.float32))


def test_csv_values_arrive_as_bytes_and_are_parsed_per_row():
    columns = {
        "id": pa.array(["r1", "r2", "r3", "r4", None]),
        "a": pa.array([b"1.5", b"abc", b"", b"\xff\xfe", b"2"], pa.binary()),
        "b": pa.array([b"2", b"2", b"2", b"2", b"inf"], pa.binary()),
    }
    checked = check_batch(columns, 5, tabular("csv"))
    assert checked.reasons == [
        None,
        "column 'a': not a number ('abc')",
        "column 'a': empty",
        "column 'a': not valid UTF-8 text",
        "column 'id': null",  # the id's own problem comes first
    ]
    np.testing.assert_array_equal(checked.raw, np.asarray([[1.5, 2.0]], np.float32))


def test_json_lines_bad_json_missing_keys_and_wrong_types_are_bad_rows():
    lines = [
        b'{"id": 1, "a": 1, "b": 2}',
        b'{"id": 2, "a": "x", "b": 2}',
        b'{"id": 3, "b": 2}',
        b'{"id": 4, "a": true, "b": 2}',
        b"{not json",
        b"[1, 2]",
        b'{"id": 7, "a": 1e999, "b": 2}',  # JSON's overflow reads as infinity
    ]
    spec = tabular("jsonl")
    columns, known, where = json_line_columns(lines, range(1, 8), ["/d/in.jsonl"] * 7, spec)
    assert columns["a"][2] is MISSING and where[4] == "in.jsonl:5"
    checked = check_batch(columns, len(lines), spec, known)
    reasons = checked.reasons
    assert reasons[0] is None
    assert reasons[1] == "column 'a': not a number ('x')"
    assert reasons[2] == "column 'a': missing"
    assert reasons[3] == "column 'a': expected a number, got a boolean"
    assert reasons[4].startswith("line: not valid JSON")
    assert reasons[5] == "line: expected a JSON object, got list"
    assert reasons[6] == "column 'a': not a finite number (inf)"
    assert checked.good.tolist() == [0]


def test_text_rows_refuse_undecodable_bytes_lone_surrogates_and_numbers():
    spec = InputSpec.of(TEXT, "id", "jsonl")
    columns = {"id": [1, 2, 3, 4], "text": ["fine", "\ud800 bad", 7, b"\xff"]}
    checked = check_batch(columns, 4, spec)
    assert checked.reasons == [
        None,
        "column 'text': not valid Unicode text (lone surrogate at character 0)",
        "column 'text': expected a string, got number",
        "column 'text': not valid UTF-8 (byte 0)",
    ]
    assert checked.raw == ["fine"]


def test_image_rows_need_the_right_number_of_finite_values():
    spec = InputSpec.of(IMAGE, "id")
    columns = {
        "id": pa.array([1, 2, 3, 4]),
        "image": pa.array([[0, 1, 2, 3], [0, 1], [0, 1, 2, None], None], pa.list_(pa.float32())),
    }
    checked = check_batch(columns, 4, spec)
    assert checked.reasons == [
        None,
        "column 'image': expected 4 values, got 2",
        "column 'image': not all values are finite numbers",
        "column 'image': null",
    ]
    assert checked.raw.shape == (1, 4)


def test_every_row_comes_out_once_as_a_prediction_or_a_reject():
    spec = tabular()
    columns = {"id": pa.array([7, 8, 9]), "a": pa.array([1.0, None, 2.0]), "b": pa.array([1.0] * 3)}
    checked = check_batch(columns, 3, spec)
    probabilities = np.asarray([[0.9, 0.1], [0.2, 0.8]], np.float32)
    labels = np.asarray(["no", "yes"], dtype=object)
    outputs = classifier_outputs(probabilities, labels)
    table = outputs_table(columns, "id", checked, outputs, None, ("m", "3"))
    good, bad = split_predictions(table, "id")
    out = good.to_pydict()
    np.testing.assert_array_equal(np.asarray(out.pop("probabilities"), np.float32), probabilities)
    assert out == {
        "id": [7, 9],
        "label": ["no", "yes"],
        "model_name": ["m", "m"],
        "model_version": ["3", "3"],
    }
    assert good.schema.field("id").type == pa.int64()  # the input's id type is kept
    assert bad.to_pylist() == [
        {"id": "8", "reason": "column 'a': null", "row": '{"id": 8, "a": null, "b": 1.0}'}
    ]


def test_a_piece_is_written_as_parts_and_rejects_and_only_its_record_returns(tmp_path):
    from app.predict.write import Destination, PieceOutput, records_table, written_records

    spec = tabular()
    columns = {
        "id": pa.array([1, 2, 3, 4, 5]),
        "a": pa.array([1.0, None, 2.0, 3.0, 4.0]),
        "b": pa.array([1.0] * 5),
    }
    checked = check_batch(columns, 5, spec)
    outputs = classifier_outputs(np.full((4, 2), 0.5, np.float32), np.asarray(["n", "y"], object))
    table = outputs_table(columns, "id", checked, outputs, None, ("m", "3"))
    out = PieceOutput(Destination(str(tmp_path), "_run-x", "id", 3, 5), piece=7)
    assert out.add(table.slice(0, 2)) and out.add(table.slice(2))  # two batches, one piece
    [record] = written_records(records_table([out.close()]))
    assert (record.output, record.rejected) == (4, 1)
    assert [p["rows"] for p in record.parts] == [3, 1] and len(record.rejects) == 1
    assert record.examples == [{"id": "2", "reason": "column 'a': null"}]
    ids = [i for p in record.parts for i in pq.read_table(tmp_path / p["file"])["id"].to_pylist()]
    assert ids == [1, 3, 4, 5]
    assert [p["file"] for p in record.parts] == [
        "_run-x/part-00000-000007.parquet",
        "_run-x/part-00001-000007.parquet",
    ]
    assert record.rejects[0]["file"] == "_run-x/rejects/part-00000-000007.parquet"


def test_a_piece_whose_id_type_changes_stops_and_names_both_schemas(tmp_path):
    from app.predict.write import Destination, PieceOutput

    spec = tabular()
    out = PieceOutput(Destination(str(tmp_path), "_run-x", "id", 10, 5), piece=0)
    for ids in (pa.array([1, 2]), pa.array(["a", "b"])):
        columns = {"id": ids, "a": pa.array([1.0, 2.0]), "b": pa.array([1.0, 2.0])}
        probabilities = np.full((2, 2), 0.5, np.float32)
        outputs = classifier_outputs(probabilities, np.asarray(["n", "y"], object))
        added = out.add(
            outputs_table(columns, "id", check_batch(columns, 2, spec), outputs, None, ("m", "3"))
        )
    assert not added
    record = out.close()
    assert record.output == 2 and len(record.schemas) == 2
    assert "id: int64" in record.schemas[0] and "id: string" in record.schemas[1]


def test_input_files_by_extension_and_folder(tmp_path):
    (tmp_path / "one.csv").write_text("id,a,b\n1,2,3\n")
    assert input_files(str(tmp_path / "one.csv")) == ("csv", [str(tmp_path / "one.csv")])
    folder = tmp_path / "parts"
    folder.mkdir()
    for name in ("p1.jsonl", "p0.jsonl", "_SUCCESS", ".hidden.jsonl"):
        (folder / name).write_text("{}\n")
    fmt, files = input_files(str(folder))
    assert fmt == "jsonl" and [os.path.basename(f) for f in files] == ["p0.jsonl", "p1.jsonl"]
    (folder / "p2.parquet").write_text("")
    with pytest.raises(UserError, match="mixes formats"):
        input_files(str(folder))
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(UserError, match="x.txt: unknown format"):
        input_files(str(tmp_path / "x.txt"))
    with pytest.raises(UserError, match="no such file or folder"):
        input_files(str(tmp_path / "nope"))


def test_a_file_without_a_model_column_is_refused_by_name(tmp_path):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"id": [1, 2], "a": [1.0, 2.0], "b": [3.0, 4.0], "x": [0, 0]}), good)
    assert check_columns([str(good)], tabular()) == 2  # Parquet's own row count
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": [1], "a": [1.0], "B": [3.0]}), bad)
    with pytest.raises(UserError, match=r"bad.parquet: no column 'b' \(a feature column"):
        check_columns([str(good), str(bad)], tabular())
    csv = tmp_path / "in.csv"
    csv.write_text("key,a,b\n1,2,3\n")
    with pytest.raises(UserError, match=r"in.csv: no column 'id' \(--id-column\); it has 'key'"):
        check_columns([str(csv)], tabular("csv"))


def test_parts_roll_over_and_the_manifest_verifies(tmp_path):
    writer = PartWriter(str(tmp_path), "", rows_per_file=4, run="r")
    for start in (0, 3, 6):
        writer.write(pa.table({"id": list(range(start, start + 3))}))
    shards = writer.close()
    assert [s.rows for s in shards] == [4, 4, 1]
    assert pq.read_table(tmp_path / shards[2].file)["id"].to_pylist() == [8]
    manifest = manifest_of(shards, rows=9)
    manifest.write(str(tmp_path / "manifest.json"))
    assert verify_output(str(tmp_path)).rows["output"] == 9
    with open(tmp_path / shards[0].file, "ab") as f:
        f.write(b"x")
    with pytest.raises(UserError, match=f"{shards[0].file}: sha256 differs"):
        verify_output(str(tmp_path))


def test_a_later_batch_with_another_id_type_is_refused(tmp_path):
    writer = PartWriter(str(tmp_path), "", rows_per_file=10, run="r")
    writer.write(pa.table({"id": [1, 2]}))
    writer.write(pa.table({"id": pa.array([3], pa.int32())}))  # castable: kept as int64
    with pytest.raises(UserError, match="column types differ"):
        writer.write(pa.table({"id": ["x"]}))


def test_an_existing_output_is_replaced_only_with_overwrite_and_only_a_predict_output(tmp_path):
    check_output(str(tmp_path / "new"), overwrite=False)  # absent: fine
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="is not a predict output"):
        check_output(str(tmp_path / "data"), overwrite=True)
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"kind": "tabular"}))
    with pytest.raises(UserError, match="manifest.json"):
        check_output(str(tmp_path / "data"), overwrite=True)
    out = tmp_path / "out"
    commit(str(out), run_manifest(out, "_run-a"))
    with pytest.raises(UserError, match="--overwrite"):
        check_output(str(out), overwrite=False)
    check_output(str(out), overwrite=True)


def manifest_of(shards, rows: int) -> PredictionManifest:
    """A predict manifest naming `shards` (all predictions, no rejects)."""
    return PredictionManifest(
        created="now",
        artifact="a",
        model_name="m",
        model_version="1",
        variant="int8",
        input="i",
        input_format="parquet",
        id_column="id",
        on_bad_rows="fail",
        rows={"input": rows, "output": rows, "rejected": 0},
        files=shards,
        rejects=[],
    )


def run_manifest(out, run: str, rows: int = 3) -> PredictionManifest:
    """A run's parts written under `<out>/<run>/` and its (uncommitted) manifest."""
    writer = PartWriter(str(out), run, rows_per_file=2, run=run)
    writer.write(pa.table({"id": list(range(rows))}))
    shards = writer.close()
    return manifest_of(shards, rows)


def test_a_run_counts_only_once_its_manifest_is_in_and_replaces_the_last_one_whole(tmp_path):
    import pyarrow.dataset as pads

    out = tmp_path / "out"
    first = run_manifest(out, "_run-1")
    # Before the commit a reader of the folder finds nothing: `_` folders are skipped.
    assert pads.dataset(str(out), format="parquet").to_table().num_rows == 0
    commit(str(out), first)
    assert verify_output(str(out)).rows["output"] == 3
    crashed = run_manifest(out, "_run-2", rows=5)  # a run that never commits
    second = run_manifest(out, "_run-3", rows=4)
    commit(str(out), second)
    assert verify_output(str(out)).rows["output"] == 4
    assert not (out / "_run-1").exists()  # the replaced run's parts are gone
    assert (out / "_run-2").exists() and crashed.files  # not named by a manifest: left alone
    # A run that read the first manifest as "replaced" after the second committed could only
    # delete the first's parts, never the second's.
    commit(str(out), second)
    assert verify_output(str(out)).rows["output"] == 4


def test_the_job_fails_with_one_line_before_any_work(capsys, tmp_path):
    from jobs.predict import main
    from tests.unit.unit_helpers import run_main

    base = ["--artifact", str(tmp_path / "a"), "--output", str(tmp_path / "out")]
    code, out, err = run_main(capsys, main, [*base, "--input", str(tmp_path / "none.csv")])
    assert (code, out) == (1, "")
    assert err.strip().splitlines()[-1] == f"error: {tmp_path / 'none.csv'}: no such file or folder"
    (tmp_path / "in.csv").write_text("id,a\n1,2\n")
    code, _, err = run_main(
        capsys, main, [*base, "--input", str(tmp_path / "in.csv"), "predict.on_bad_rows=skip"]
    )
    assert code == 2 and "predict.on_bad_rows" in err.strip().splitlines()[-1]
    code, _, err = run_main(capsys, main, [*base, "--input", str(tmp_path / "in.csv")])
    assert code == 1 and err.strip().splitlines()[-1].endswith("no such artifact")


def test_two_runs_to_one_output_without_overwrite_publish_only_the_first(tmp_path):
    out = tmp_path / "out"
    check_output(str(out), overwrite=False)  # both runs start before either commits
    check_output(str(out), overwrite=False)
    first, second = run_manifest(out, "_run-a", rows=3), run_manifest(out, "_run-b", rows=5)
    commit(str(out), first, overwrite=False)
    with pytest.raises(UserError, match="another predict run committed there"):
        commit(str(out), second, overwrite=False)
    assert verify_output(str(out)).rows["output"] == 3  # the first run's output, whole
    commit(str(out), second, overwrite=True)  # --overwrite replaces it
    assert verify_output(str(out)).rows["output"] == 5


def test_a_folder_of_pictures_is_an_input_of_its_own_read_in_runs_of_names(tmp_path, monkeypatch):
    from app.predict import read

    for name in ("b/2.jpg", "a/1.png", "a/deep/3.JPEG", ".hidden/4.png", "notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert read.input_files(str(tmp_path)) == ("pictures", [str(tmp_path)])
    monkeypatch.setattr(read, "PIECE_PICTURES", 2)
    pieces = read.picture_pieces(str(tmp_path))
    assert [p["names"] for p in pieces] == [["a/1.png", "a/deep/3.JPEG"], ["b/2.jpg"]]
    (tmp_path / "rows.csv").write_text("id,image\n")  # a table beside them: the table is read
    assert read.input_files(str(tmp_path))[0] == "csv"
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty: no csv/jsonl/parquet files, and no PNG or JPEG"):
        read.input_files(str(tmp_path / "empty"))
