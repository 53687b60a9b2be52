"""Bad input: one UserError line naming the file / column / row, and no output folder left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from app.errors import UserError
from app.pipeline.stages import prepare
from tests.unit.unit_helpers import staging_leftovers

pytestmark = pytest.mark.unit


@pytest.fixture
def refused(config_factory, tmp_path):
    """Run prepare with overrides; return the UserError message after checking nothing was written."""

    def run(*overrides: str) -> str:
        config = config_factory(*overrides)
        with pytest.raises(UserError) as info:
            prepare(config)
        message = str(info.value)
        assert message and "\n" not in message, repr(message)
        assert not os.path.exists(config.data_output)
        assert staging_leftovers(tmp_path) == []
        return message

    return run


def write_csv(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_missing_path(refused, tmp_path):
    path = tmp_path / "nope.csv"
    message = refused("data.source=table", f"data.path={path}")
    assert str(path) in message and "does not exist" in message


def test_missing_image_folder(refused, tmp_path):
    path = tmp_path / "no-images"
    assert str(path) in refused("data.source=imagefolder", f"data.path={path}")


def test_folder_without_tables(refused, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("nothing here")
    assert str(tmp_path / "empty") in refused(
        "data.source=table", f"data.path={tmp_path / 'empty'}"
    )


@pytest.mark.parametrize(("name", "text"), [("empty.csv", ""), ("header.csv", "a,b,label\n")])
def test_empty_csv(refused, tmp_path, name, text):
    path = write_csv(tmp_path / name, text)
    assert str(path) in refused("data.source=table", f"data.path={path}")


def test_missing_label_column(refused, tmp_path):
    path = write_csv(tmp_path / "t.csv", "a,b,target\n1,2,x\n3,4,y\n")
    message = refused("data.source=table", f"data.path={path}")
    assert str(path) in message and "'label'" in message


def test_missing_declared_feature_column(refused, tmp_path):
    path = write_csv(tmp_path / "t.csv", "a,label\n1,x\n3,y\n")
    message = refused("data.source=table", f"data.path={path}", "data.feature_columns=[a, b]")
    assert str(path) in message and "missing column 'b'" in message


def test_extra_column_when_features_declared(refused, tmp_path):
    path = write_csv(tmp_path / "t.csv", "a,b,c,label\n1,2,3,x\n4,5,6,y\n")
    message = refused("data.source=table", f"data.path={path}", "data.feature_columns=[a, b]")
    assert str(path) in message and "'c'" in message


def test_second_file_missing_an_inferred_column(refused, tmp_path):
    # Without declared features they are inferred from the first file; a later file that lacks
    # one must be refused by name, not crash with a KeyError.
    write_csv(tmp_path / "d" / "1.csv", "a,b,label\n1,2,x\n3,4,y\n5,6,x\n")
    second = write_csv(tmp_path / "d" / "2.csv", "a,label\n1,x\n3,y\n")
    message = refused("data.source=table", f"data.path={tmp_path / 'd'}")
    assert str(second) in message and "'b'" in message


@pytest.mark.parametrize("value", ["abc", "", "inf"])
def test_non_numeric_feature_names_file_column_row(refused, tmp_path, value):
    path = write_csv(tmp_path / "t.csv", f"a,b,label\n1,2,x\n3,4,y\n5,{value},x\n7,8,y\n")
    message = refused("data.source=table", f"data.path={path}")
    assert str(path) in message
    assert "'b'" in message
    assert "row 2" in message


def test_non_text_value_in_text_column(refused, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "fine", "label": "a"}\n{"text": 12, "label": "b"}\n')
    message = refused("data.source=table", f"data.path={path}", "data.text_column=text")
    assert str(path) in message and "'text'" in message and "row 1" in message


def test_unreadable_image(refused, tmp_path):
    root = tmp_path / "images"
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        Image.new("RGB", (5, 5), (1, 2, 3)).save(root / name / "ok.png")
    bad = root / "dog" / "broken.png"
    bad.write_bytes(b"\x89PNG this is not really an image")
    message = refused("data.source=imagefolder", f"data.path={root}")
    assert str(bad) in message and "unreadable image" in message


def test_image_folder_without_classes(refused, tmp_path):
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (5, 5)).save(tmp_path / "flat" / "a.png")
    assert "class" in refused("data.source=imagefolder", f"data.path={tmp_path / 'flat'}")


def test_label_outside_declared_labels_names_file_and_row(refused, tmp_path):
    write_csv(tmp_path / "d" / "1.csv", "a,label\n1,x\n2,y\n3,x\n")
    second = write_csv(tmp_path / "d" / "2.csv", "a,label\n1,x\n2,z\n")
    message = refused("data.source=table", f"data.path={tmp_path / 'd'}", "data.labels=[x, y]")
    assert "'z'" in message
    assert f"{second} row 1" in message


def test_label_outside_declared_labels_builtin_source(refused):
    message = refused("data.labels=['0', '1']")
    assert "'2'" in message and "data.labels" in message


def test_missing_label_names_file_and_row(refused, tmp_path):
    write_csv(tmp_path / "d" / "1.csv", "a,label\n1,x\n2,y\n3,x\n")
    second = write_csv(tmp_path / "d" / "2.csv", "a,label\n1,x\n2,\n")
    message = refused("data.source=table", f"data.path={tmp_path / 'd'}")
    assert "'label'" in message
    assert f"{second} row 1" in message


def test_unparseable_parquet(refused, tmp_path):
    bad = tmp_path / "t.parquet"
    bad.write_bytes(b"PAR1 garbage")
    assert str(bad) in refused("data.source=table", f"data.path={bad}")


def test_too_few_rows_to_split(refused, tmp_path):
    path = tmp_path / "t.parquet"
    pd.DataFrame({"a": [1.0], "label": ["x"]}).to_parquet(path)
    assert "too few" in refused("data.source=table", f"data.path={path}")
