"""The JSON files stages hand each other, as typed contracts: the dataset manifest (the checkpoint
meta.json and the artifact manifest are tested beside their modules, test_checkpoint.py and
test_artifact.py). A file of the wrong shape is one line naming the file and the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from app.data.prepare import MANIFEST, DatasetManifest, read_manifest
from app.errors import UserError, validation_line
from app.pipeline.stages import prepare

pytestmark = pytest.mark.unit

# Every key tools and tests read in a dataset manifest; none may be removed or renamed.
DATASET_KEYS = {
    "layout",
    "created",
    "source",
    "kind",
    "feature_columns",
    "label_column",
    "label_names",
    "image_shape",
    "schema",
    "rows",
    "splits",
    "files",  # other files of the dataset by name (a token dataset's tokenizer.json)
    "block_size",  # a token dataset's model input length
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, config_maker) -> Path:
    """A small prepared dataset; tests damage copies of its manifest."""
    config = config_maker(tmp_path_factory.mktemp("contracts"), "data.source=wine")
    prepare(config)
    return Path(config.data_output)


@pytest.fixture
def manifest_file(dataset: Path, tmp_path: Path) -> Callable[[dict], str]:
    """Write a manifest (by default the real one) into a fresh folder; return the folder."""

    def write(manifest: dict) -> str:
        folder = tmp_path / "data"
        folder.mkdir(exist_ok=True)
        (folder / MANIFEST).write_text(json.dumps(manifest))
        return str(folder)

    return write


def real(dataset: Path) -> dict:
    return json.loads((dataset / MANIFEST).read_text())


def test_manifest_on_disk_keeps_its_keys_and_reads_back_typed(dataset):
    on_disk = real(dataset)
    assert set(on_disk) == DATASET_KEYS
    assert set(on_disk["splits"]["train"]["shards"][0]) == {"file", "rows", "sha256"}
    manifest = read_manifest(str(dataset))
    assert isinstance(manifest, DatasetManifest)
    assert manifest.kind == "tabular" and manifest.rows == on_disk["rows"]
    assert manifest.columns == on_disk["schema"]
    assert manifest.to_json_dict() == on_disk  # the same file, written again


@pytest.mark.parametrize("layout", [None, 1])
def test_a_dataset_of_an_older_layout_is_refused_asking_to_prepare_again(
    dataset, manifest_file, layout
):
    data = real(dataset)
    data.pop("layout")
    if layout is not None:
        data["layout"] = layout
    with pytest.raises(UserError, match=r"prepared in layout 1, .* run jobs.prepare again"):
        read_manifest(manifest_file(data))


def test_unknown_keys_are_kept(dataset, manifest_file):
    data = real(dataset) | {"written_by": "a newer prepare"}
    manifest = read_manifest(manifest_file(data))
    assert manifest["written_by"] == "a newer prepare"
    assert manifest.to_json_dict()["written_by"] == "a newer prepare"


def drop(key: str) -> Callable[[dict], None]:
    return lambda m: m.pop(key)


def set_at(value, *path: str | int) -> Callable[[dict], None]:
    def damage(m: dict) -> None:
        node = m
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value

    return damage


def without_val_split(m: dict) -> None:
    """Consistent (rows and splits agree) but without the split every stage needs."""
    m["rows"].pop("val")
    m["splits"].pop("val")


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        (drop("label_column"), "label_column"),
        (drop("splits"), "splits"),
        (set_at("many", "rows", "train"), "rows.train"),
        (set_at("video", "kind"), "kind"),
        (set_at(None, "splits", "train", "shards", 0, "sha256"), "splits.train.shards[0].sha256"),
        (set_at([], "splits", "train", "shards", 0), "splits.train.shards[0]"),
        (without_val_split, "splits"),
    ],
)
def test_manifest_of_the_wrong_shape_names_file_and_field(dataset, manifest_file, damage, field):
    data = real(dataset)
    damage(data)
    folder = manifest_file(data)
    with pytest.raises(UserError) as info:  # never a KeyError later
        read_manifest(folder)
    message = str(info.value)
    assert message.startswith(f"{folder}/{MANIFEST}: {field}"), message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"a string"'])
def test_manifest_that_is_not_an_object_is_one_line(manifest_file, tmp_path, text):
    folder = manifest_file({})
    Path(folder, MANIFEST).write_text(text)
    with pytest.raises(UserError, match=rf"^{folder}/{MANIFEST}: ") as info:
        read_manifest(folder)
    assert "\n" not in str(info.value)


# --- pydantic's error as one line ----------------------------------------------------------------


class Inner(BaseModel):
    size: int


class Outer(BaseModel):
    name: str
    items: list[Inner]
    numbers: dict[str, float | int] = {}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"items": []}, "name: Field required"),
        ({"name": "n", "items": [{"size": 1}, {"size": "x"}]}, "items[1].size: "),
        # A union's members are pydantic's steps, not keys of the file: left out of the path.
        ({"name": "n", "items": [], "numbers": {"a": "b"}}, "numbers.a: "),
        ([1], "expected a JSON object, got list"),
    ],
)
def test_validation_line_names_the_field_by_its_path_in_the_file(data, expected):
    with pytest.raises(ValidationError) as info:
        Outer.model_validate(data)
    line = validation_line(info.value, data)
    assert line.startswith(expected), line
    assert "\n" not in line
