"""Bad rows counted by reason: one reason whatever each row's own values (paths, numbers), the
first of each kept whole (a path shown whole up to 300 characters, or its tail), and prepare's
summary and refusals saying how many rows each reason took, which setting admits them, and
that none was left when every row was skipped."""

from __future__ import annotations

import pandas as pd
import pytest

from app.config import DataConfig
from app.data.reasons import Reasons, reason_of, shown
from app.errors import UserError
from tests.unit.test_hostile_data import GOOD, png, table_folder  # noqa: F401 - a fixture
from tests.unit.unit_helpers import prepared_rows

pytestmark = pytest.mark.unit

CANNOT = "cannot read (missing, not a regular file, or not under the table's folder or "


@pytest.mark.parametrize(
    "a, b",
    [
        ("p.csv row 2: image '/a/b.png': " + CANNOT, "p.csv row 9: image '/c.png': " + CANNOT),
        ("t.csv row 1: column 'x': not a number ('n/a')", "t.csv row 4: column 'x': not a number ('?')"),
        ("c.jsonl:3: 418 tokens, over model.max_length + 1 = 65", "c.jsonl:9: 70 tokens, over model.max_length + 1 = 65"),
        ("c.jsonl:3: messages[0].role 'tool' is not one of system", "c.jsonl:5: messages[2].role 'x' is not one of system"),
    ],
    ids=["paths", "values", "lengths", "roles"],
)  # fmt: skip
def test_rows_differing_only_in_their_own_values_share_a_reason(a, b):
    assert reason_of(a) == reason_of(b)


def test_a_columns_name_and_the_kind_of_problem_make_different_reasons():
    assert reason_of("t.csv row 1: column 'x': null") != reason_of("t.csv row 1: column 'y': null")
    assert reason_of("t.csv row 1: column 'x': null") != reason_of("t.csv row 1: column 'x': empty")


def test_reasons_count_rows_keep_each_first_and_merge_in_order():
    first, later = Reasons(), Reasons()
    first.add("a.csv row 1: column 'x': null")
    later.add("b.csv row 7: column 'x': null", rows=2)
    later.add("b.csv row 8: column 'y': empty")
    first.merge(later)
    assert first.total() == 4
    assert first.as_list() == [
        {"reason": "column 'x': null", "rows": 3, "first": "a.csv row 1: column 'x': null"},
        {"reason": "column 'y': empty", "rows": 1, "first": "b.csv row 8: column 'y': empty"},
    ]
    assert first.line().startswith("3 column 'x': null (first: a.csv row 1: column 'x': null); 1")


def test_a_long_path_is_shown_whole_up_to_300_characters_else_by_its_tail():
    path = "/data/" + "deep/" * 80 + "flowers/s/rose-17.png"
    assert shown("/data/x.png") == "'/data/x.png'"
    assert len(shown(path)) == 302 and shown(path).endswith("flowers/s/rose-17.png'")
    assert shown(path).startswith("'...")


def test_a_table_whose_every_picture_lies_outside_fails_counting_them_by_reason(tmp_path):
    """The user's case: every row skipped for one reason; the refusal says how many of how
    many, why (naming data.image_roots), and the first one's whole path."""
    outside = tmp_path / ("elsewhere/" + "png/plants/flowers/" * 4)
    outside.mkdir(parents=True)
    images = []
    for i in range(5):
        (outside / f"s{i}.png").write_bytes(png(8, 8))
        images.append(str(outside / f"s{i}.png"))
    folder = tmp_path / "table"
    folder.mkdir()
    frame = pd.DataFrame({"image": images, "caption": ["x"] * 5})
    frame.to_csv(folder / "pairs.csv", index=False)
    data = DataConfig(source="image_text", path=str(folder / "pairs.csv"), skip_bad_rows=True)
    with pytest.raises(UserError) as refused:
        prepared_rows(data, tmp_path / "out")
    message = str(refused.value)
    assert "5 of 5 rows skipped, none left: 5 image '...': cannot read" in message
    assert "data.image_roots" in message
    assert f"pairs.csv row 0: image {images[0]!r}: cannot read" in message  # the whole path


def test_skipped_rows_are_summarised_by_reason(table_folder):  # noqa: F811 - the fixture
    images = ["missing.png", "gone.png", *(f"pics/ok{i}.png" for i in range(GOOD))]
    images += ["pics/ok0.png"]
    captions = ["x", "x", *["x"] * GOOD, None]  # one caption missing
    pd.DataFrame({"image": images, "caption": captions}).to_csv(
        table_folder / "pairs.csv", index=False
    )
    data = DataConfig(
        source="image_text",
        path=str(table_folder / "pairs.csv"),
        val_fraction=0.5,
        skip_bad_rows=True,
    )
    _, summary = prepared_rows(data, table_folder.parent / "out")
    reasons = {r["reason"]: r for r in summary["skipped_reasons"]}
    assert summary["skipped"] == 3 and sum(r["rows"] for r in reasons.values()) == 3
    unreadable = reasons["image '...': " + CANNOT + "data.image_roots)"]
    assert unreadable["rows"] == 2 and "row 0: image 'missing.png'" in unreadable["first"]
    assert len(reasons) == 2  # and the missing caption, its own reason


def test_a_refused_source_counts_every_bad_row_by_reason(table_folder):  # noqa: F811
    images = ["missing.png", "gone.png", "lost.png", *(f"pics/ok{i}.png" for i in range(GOOD))]
    pd.DataFrame({"image": images, "caption": ["x"] * len(images)}).to_csv(
        table_folder / "pairs.csv", index=False
    )
    data = DataConfig(source="image_text", path=str(table_folder / "pairs.csv"), val_fraction=0.5)
    with pytest.raises(UserError) as refused:
        prepared_rows(data, table_folder.parent / "out")
    message = str(refused.value)
    assert message.split(": ", 1)[0].endswith("pairs.csv row 0")  # the first bad row, first
    assert "image 'missing.png': cannot read" in message
    assert "(data.skip_bad_rows=true skips such rows); 3 bad rows in all: 3 image '...'" in message
