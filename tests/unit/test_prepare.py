"""app/data/sources.py + app/data/prepare.py on tiny data (pieces run in this process): shards, manifest, raw values, determinism, atomicity."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from sklearn import datasets

import app.data.prepare
from app.data.kinds.image import stored_pixels
from app.data.pieces import SplitRule, row_keys
from app.data.prepare import (
    GENERATION_MARK,
    MANIFEST,
    DatasetManifest,
    current_generation,
    read_manifest,
    split_files,
    verify_shards,
)
from app.data.table_source import plan
from app.errors import UserError
from app.pipeline.stages import prepare
from tests.unit.unit_helpers import read_split, sha256_of, snapshot, staging_leftovers

pytestmark = pytest.mark.unit


def check_dataset(output: str, summary: dict) -> DatasetManifest:
    """The manifest lists exactly the shards on disk, with matching rows and sha256."""
    manifest = read_manifest(output)
    assert summary["output"] == output
    assert summary["rows"] == manifest.rows
    assert set(summary["rows"]) == set(manifest.splits)
    listed = set()
    for split, entry in manifest.splits.items():
        assert entry.rows == sum(s.rows for s in entry.shards) == summary["rows"][split]
        for shard in entry.shards:
            path = os.path.join(output, shard.file)
            assert sha256_of(path) == shard.sha256, shard.file
            assert pq.read_metadata(path).num_rows == shard.rows
            listed.add(shard.file)
    generation = current_generation(output)
    assert generation.startswith(GENERATION_MARK)  # every shard sits in the manifest's generation
    on_disk = {str(p.relative_to(output)) for p in (Path(output) / generation).rglob("*.parquet")}
    assert listed == on_disk
    assert staging_leftovers(Path(output).parent) == []
    return manifest


# --- scikit-learn sources -----------------------------------------------------------------------


def splits_of(rows: int, val: float, test: float, seed: int = 0) -> dict[str, np.ndarray]:
    """A made source's rows of each split, in source order: a row's split is a function of
    (seed, its number) alone."""
    codes = SplitRule(seed, val, test).codes(np.arange(rows, dtype=np.uint64))
    return {
        name: np.flatnonzero(codes == code) for code, name in enumerate(("train", "val", "test"))
    }


def test_digits_shards_hold_raw_pixels_and_every_row(config_factory):
    config = config_factory()
    summary = prepare(config)
    assert summary["stage"] == "prepare"
    idx = splits_of(1797, 0.2, 0.0)
    assert summary["rows"] == {"train": len(idx["train"]), "val": len(idx["val"])}
    assert abs(len(idx["val"]) / 1797 - 0.2) <= 4 * np.sqrt(0.2 * 0.8 / 1797)  # reported, near
    manifest = check_dataset(config.data_output, summary)
    assert manifest.kind == "image"
    assert manifest.image_shape == [1, 8, 8]
    assert manifest.label_names == [str(d) for d in range(10)]
    train = len(idx["train"])
    assert [s.rows for s in manifest.splits["train"].shards] == [500, 500, train - 1000]

    bunch = datasets.load_digits()
    for split in ("train", "val"):
        frame = read_split(config.data_output, manifest, split)
        assert {len(v) for v in frame["image"]} == {64}  # a row's pixels, a byte each
        pixels = stored_pixels(frame["image"], 64)
        assert pixels.shape == (len(idx[split]), 64)
        # Raw values, unchanged: integers 0..16, exactly the source's rows in source order.
        assert pixels.min() == 0 and pixels.max() == 16
        np.testing.assert_array_equal(pixels, bunch.data[idx[split]])
        assert frame["label"].tolist() == [str(t) for t in bunch.target[idx[split]]]


@pytest.mark.parametrize(
    ("source", "rows", "features", "classes"), [("breast_cancer", 569, 30, 2), ("wine", 178, 13, 3)]
)
def test_sklearn_tables_keep_raw_numbers(config_factory, source, rows, features, classes):
    config = config_factory(f"data.source={source}", "data.test_fraction=0.1")
    summary = prepare(config)
    assert sum(summary["rows"].values()) == rows
    assert set(summary["rows"]) == {"train", "val", "test"}
    manifest = check_dataset(config.data_output, summary)
    assert manifest.kind == "tabular"
    assert len(manifest.feature_columns) == features
    assert all(c.replace("_", "").isalnum() for c in manifest.feature_columns)
    assert len(manifest.label_names) == classes
    bunch = getattr(datasets, f"load_{source}")()
    idx = splits_of(rows, 0.2, 0.1)
    frame = read_split(config.data_output, manifest, "test")
    np.testing.assert_array_equal(
        frame[manifest.feature_columns].to_numpy(), bunch.data[idx["test"]]
    )
    assert frame["label"].tolist() == [
        str(bunch.target_names[t]) for t in bunch.target[idx["test"]]
    ]


def test_a_label_outside_data_labels_is_refused_by_row(config_factory):
    config = config_factory("data.source=wine", "data.labels=[class_0, class_1]")
    with pytest.raises(UserError, match=r"column 'label': label 'class_2' at row 130 is not in"):
        prepare(config)
    assert no_dataset(config.data_output)


# --- generators ---------------------------------------------------------------------------------


def test_synthetic_text(config_factory):
    config = config_factory("data.source=synthetic_text", "data.num_rows=40", "data.num_classes=3")
    summary = prepare(config)
    assert sum(summary["rows"].values()) == 40
    manifest = check_dataset(config.data_output, summary)
    assert manifest.kind == "text" and manifest.feature_columns == ["text"]
    assert set(manifest.label_names) <= {"class_0", "class_1", "class_2"}
    frame = pd.concat([read_split(config.data_output, manifest, s) for s in ("train", "val")])
    for text, label in zip(frame["text"], frame["label"], strict=True):
        assert isinstance(text, str)
        # Every sentence carries at least one keyword of its own class, never negated, and any
        # keyword of another class is negated ("without topicK_j").
        own = f"topic{label.removeprefix('class_')}_"
        words = text.split()
        assert sum(w.startswith(own) for w in words) >= 1
        for i, w in enumerate(words):
            if w.startswith("topic"):
                assert (i > 0 and words[i - 1] == "without") != w.startswith(own)


def test_synthetic_image(config_factory):
    config = config_factory("data.source=synthetic_image", "data.num_rows=30", "data.image_size=8")
    summary = prepare(config)
    assert sum(summary["rows"].values()) == 30
    manifest = check_dataset(config.data_output, summary)
    assert manifest.kind == "image" and manifest.image_shape == [1, 8, 8]
    pixels = stored_pixels(read_split(config.data_output, manifest, "train")["image"], 64)
    assert pixels.shape[1] == 64
    assert pixels.min() >= 0 and pixels.max() <= 255 and pixels.max() > 16
    np.testing.assert_array_equal(pixels, np.round(pixels))  # raw 0..255 integers


# --- image folders ------------------------------------------------------------------------------

COLOURS = {"cat": (255, 0, 0), "dog": (0, 0, 255)}


def make_image_folder(root: Path, per_class: int = 10) -> Path:
    for name, colour in COLOURS.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (10 + i, 12), colour).save(root / name / f"{i}.png")
    (root / "cat" / "notes.txt").write_text("not an image, skipped")
    return root


def test_imagefolder(config_factory, tmp_path):
    folder = make_image_folder(tmp_path / "images")
    config = config_factory("data.source=imagefolder", f"data.path={folder}", "data.image_size=4")
    summary = prepare(config)
    assert sum(summary["rows"].values()) == 20
    manifest = check_dataset(config.data_output, summary)
    assert manifest.kind == "image"
    assert manifest.image_shape == [3, 4, 4]
    assert manifest.columns["image"] == "large_binary"  # a row's uint8 pixels as its bytes
    assert manifest.label_names == ["cat", "dog"]
    frame = pd.concat([read_split(config.data_output, manifest, s) for s in ("train", "val")])
    assert {len(v) for v in frame["image"]} == {48}
    for pixels, label in zip(frame["image"], frame["label"], strict=True):
        image = np.frombuffer(pixels, np.uint8).reshape(3, 4, 4)  # channels first, raw 0..255
        for channel, value in enumerate(COLOURS[label]):
            assert (image[channel] == value).all()


# --- tables: CSV, JSONL, Parquet ----------------------------------------------------------------


def table_frame(n: int = 20) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame(
        {
            "a": rng.normal(size=n).round(3),
            "b": rng.integers(0, 100, size=n),
            "label": [f"c{i % 3}" for i in range(n)],
        }
    )


def write_table(frame: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    elif path.suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path, index=False)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_table_file_formats(config_factory, tmp_path, suffix):
    raw = table_frame()
    path = write_table(raw, tmp_path / f"rows{suffix}")
    config = config_factory("data.source=table", f"data.path={path}")
    summary = prepare(config)
    assert sum(summary["rows"].values()) == 20 and summary["rows"]["val"] >= 1
    manifest = check_dataset(config.data_output, summary)
    assert manifest.kind == "tabular"
    assert manifest.feature_columns == ["a", "b"]  # inferred: every column but the label
    assert manifest.label_names == ["c0", "c1", "c2"]
    assert manifest.source["files"] == [path.name]
    # Each row's split is a function of (seed, its values): the shards hold the rows in the
    # source's order, raw values unchanged.
    spec, _ = plan(config.data)
    rows = pa.table({"a": raw["a"], "b": raw["b"], "label": raw["label"].astype(str)})
    codes = SplitRule(0, 0.2, 0.0).codes(row_keys(rows.cast(spec.schema()), rows.column_names))
    for code, split in ((0, "train"), (1, "val")):
        frame = read_split(config.data_output, manifest, split)
        np.testing.assert_array_equal(
            frame[["a", "b"]].to_numpy(), raw[["a", "b"]].to_numpy()[codes == code]
        )
        assert frame["label"].tolist() == raw["label"][codes == code].tolist()


def test_a_tables_split_holds_however_it_is_cut_and_appended_to(config_factory, tmp_path):
    """The same rows in one file or three give the same splits; rows appended later move no
    earlier row; duplicate rows share a split; the val share is near data.val_fraction."""
    raw = table_frame(3000).assign(a=np.arange(3000) % 1000 / 8)  # every row thrice
    raw["b"] = raw["a"] * 2
    raw["label"] = [f"c{int(x) % 3}" for x in raw["a"]]
    one = write_table(raw, tmp_path / "one" / "rows.parquet")
    folder = tmp_path / "three"
    for i in range(3):
        write_table(raw.iloc[i * 1000 : (i + 1) * 1000], folder / f"part-{i}.csv")
    grown = write_table(
        pd.concat([raw, raw.assign(a=raw["a"] + 1e6)]), tmp_path / "grown" / "rows.parquet"
    )

    def val_rows(path: Path, name: str) -> set[tuple]:
        config = config_factory(
            "data.source=table", f"data.path={path}", f"data.output={tmp_path / name}"
        )
        manifest = read_manifest(prepare(config)["output"])
        frame = read_split(config.data_output, manifest, "val")
        return set(zip(frame["a"], frame["b"], frame["label"], strict=True))

    val = val_rows(one, "d1")
    assert val == val_rows(folder, "d3")
    assert val <= val_rows(grown, "dg")
    share = len(val) / 1000  # distinct rows: each one's three copies share its split
    assert abs(share - 0.2) <= 4 * np.sqrt(0.2 * 0.8 / 1000)


def test_table_folder_of_mixed_files_with_declared_columns(config_factory, tmp_path):
    folder = tmp_path / "tables"
    (folder / "sub").mkdir(parents=True)
    raw = table_frame(30).assign(
        a=np.arange(30) / 4
    )  # exact in every format (JSONL rounding aside)
    write_table(raw.iloc[:10], folder / "one.csv")
    write_table(raw.iloc[10:20], folder / "sub" / "two.jsonl")
    write_table(raw.iloc[20:], folder / "three.parquet")
    config = config_factory(
        "data.source=table", f"data.path={folder}", "data.feature_columns=[b, a]"
    )
    summary = prepare(config)
    assert sum(summary["rows"].values()) == 30
    manifest = check_dataset(config.data_output, summary)
    assert manifest.feature_columns == ["b", "a"]
    frame = pd.concat([read_split(config.data_output, manifest, s) for s in ("train", "val")])
    got = sorted(zip(frame["a"], frame["b"], frame["label"], strict=True))
    assert got == sorted(zip(raw["a"], raw["b"], raw["label"], strict=True))


def test_table_numeric_labels_become_names(config_factory, tmp_path):
    raw = table_frame().assign(label=[i % 2 for i in range(20)])
    path = write_table(raw, tmp_path / "rows.csv")
    config = config_factory("data.source=table", f"data.path={path}", "data.labels=['0','1']")
    manifest = check_dataset(config.data_output, prepare(config))
    assert manifest.label_names == ["0", "1"]


def test_table_text_column(config_factory, tmp_path):
    raw = pd.DataFrame({"body": [f"hello world {i}" for i in range(20)], "y": ["pos", "neg"] * 10})
    path = write_table(raw, tmp_path / "texts.jsonl")
    config = config_factory(
        "data.source=table", f"data.path={path}", "data.text_column=body", "data.label_column=y"
    )
    manifest = check_dataset(config.data_output, prepare(config))
    assert manifest.kind == "text"
    assert manifest.feature_columns == ["body"] and manifest.label_column == "y"
    frame = read_split(config.data_output, manifest, "val")
    assert set(frame["body"]) <= set(raw["body"])


# --- determinism --------------------------------------------------------------------------------


def shard_hashes(output: str) -> list[tuple[str, str]]:
    """(path within the generation, sha256) of every shard the manifest names."""
    manifest = json.loads((Path(output) / MANIFEST).read_text())
    return [
        (s["file"].split("/", 1)[1], s["sha256"])
        for e in manifest["splits"].values()
        for s in e["shards"]
    ]


@pytest.mark.parametrize("source", ["digits", "synthetic_text", "synthetic_image"])
def test_same_seed_gives_identical_shards(tmp_path, config_maker, source):
    overrides = [f"data.source={source}", "data.num_rows=60", "data.rows_per_shard=20"]
    a = config_maker(tmp_path / "a", *overrides)
    b = config_maker(tmp_path / "b", *overrides)
    c = config_maker(tmp_path / "c", *overrides, "data.seed=1")
    prepare(a), prepare(b), prepare(c)
    assert shard_hashes(a.data_output) == shard_hashes(b.data_output)
    for file, _ in shard_hashes(a.data_output):
        ga, gb = current_generation(a.data_output), current_generation(b.data_output)
        assert (Path(a.data_output) / ga / file).read_bytes() == (
            Path(b.data_output) / gb / file
        ).read_bytes()
    assert shard_hashes(a.data_output) != shard_hashes(c.data_output)


# --- atomicity ----------------------------------------------------------------------------------


def fail_after_first_shard(monkeypatch, exc: BaseException) -> list[str]:
    from app.data import pieces

    real = pieces.sha256_and_size
    written: list[str] = []

    def flaky(path):
        if written:
            raise exc
        written.append(str(path))
        return real(path)

    monkeypatch.setattr(pieces, "sha256_and_size", flaky)  # as each shard closes
    return written


@pytest.mark.parametrize("exc", [OSError("disk full"), KeyboardInterrupt()])
def test_failure_mid_write_leaves_no_dataset(config_factory, monkeypatch, tmp_path, exc):
    config = config_factory("data.rows_per_shard=200")
    written = fail_after_first_shard(monkeypatch, exc)
    with pytest.raises(type(exc)):
        prepare(config)
    assert len(written) == 1  # the failure really came mid-write
    assert no_dataset(config.data_output)
    assert staging_leftovers(tmp_path) == []


def test_failure_mid_write_keeps_previous_dataset(config_factory, monkeypatch, tmp_path):
    config = config_factory("data.rows_per_shard=200")
    prepare(config)
    before = snapshot(config.data_output)
    assert MANIFEST in before
    fail_after_first_shard(monkeypatch, OSError("disk full"))
    again = config_factory("data.rows_per_shard=200", "data.seed=7")
    with pytest.raises(OSError):
        prepare(again)
    assert snapshot(config.data_output) == before
    assert staging_leftovers(tmp_path) == []


def test_failure_writing_manifest_leaves_nothing(config_factory, monkeypatch, tmp_path):
    config = config_factory()

    def broken(*args, **kwargs):
        raise RuntimeError("manifest failed")

    monkeypatch.setattr(app.data.prepare, "manifest_of", broken)
    with pytest.raises(RuntimeError):
        prepare(config)
    assert no_dataset(config.data_output)
    assert staging_leftovers(tmp_path) == []


def test_rerun_replaces_dataset_whole(config_factory, tmp_path):
    first = config_factory("data.rows_per_shard=200")
    prepare(first)
    second = config_factory("data.rows_per_shard=1000", "data.seed=5")
    summary = prepare(second)
    manifest = check_dataset(second.data_output, summary)
    # The new manifest names only the new shards (no stale third shard of the first run).
    generation = current_generation(second.data_output)
    assert [s.file for s in manifest.splits["train"].shards] == [
        f"{generation}/train/part-000000-0000.parquet",
        f"{generation}/train/part-000000-0001.parquet",
    ]
    assert staging_leftovers(tmp_path) == []


def test_rerun_keeps_the_dataset_a_running_job_reads_and_collects_older_ones(config_factory):
    """A train or predict job reading through the previous manifest keeps its shards: the
    newest data.keep_generations generations stay, older ones go."""
    config = config_factory("data.rows_per_shard=200")
    prepare(config)
    reading = read_manifest(config.data_output)  # a job holding the first manifest
    prepare(config_factory("data.rows_per_shard=300", "data.seed=5"))
    for split in ("train", "val"):
        verify_shards(config.data_output, reading, split)  # still whole
    prepare(config_factory("data.rows_per_shard=400", "data.seed=6"))
    generations = sorted(n for n in os.listdir(config.data_output) if n.startswith(GENERATION_MARK))
    assert len(generations) == 2  # the first one is gone
    with pytest.raises(UserError):
        verify_shards(config.data_output, reading, "train")


def no_dataset(output: str) -> bool:
    """No manifest, and nothing of a failed run's generation left behind."""
    if not os.path.exists(output):
        return True
    return not any(n == MANIFEST or n.startswith(GENERATION_MARK) for n in os.listdir(output))


def test_folder_without_manifest_is_not_a_dataset(tmp_path):
    (tmp_path / "half" / "train").mkdir(parents=True)
    table_frame().to_parquet(tmp_path / "half" / "train" / "part-00000.parquet")
    with pytest.raises(UserError, match="manifest.json"):
        read_manifest(str(tmp_path / "half"))


# --- verify_shards: the manifest's sha256 checked where shards are read ----------------------


@pytest.fixture
def prepared_small(config_factory):
    config = config_factory("data.source=wine", "data.rows_per_shard=50")
    prepare(config)
    return config.data_output, read_manifest(config.data_output)


def test_verify_shards_passes_an_intact_split(prepared_small):
    output, manifest = prepared_small
    files = verify_shards(output, manifest, "train")
    assert files == split_files(output, manifest, "train")
    assert len(files) == 3


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "problem"),
    [(flip_last_byte, "sha256"), (cut_in_half, "sha256"), (Path.unlink, "missing")],
)
def test_verify_shards_refuses_a_damaged_shard_by_name(prepared_small, damage, problem):
    output, manifest = prepared_small
    shard = manifest.splits["train"].shards[1].file
    damage(Path(output) / shard)
    with pytest.raises(UserError) as info:
        verify_shards(output, manifest, "train")
    message = str(info.value)
    assert message.startswith(f"{output}/{shard}: ") and problem in message, message
    assert "\n" not in message
    verify_shards(output, manifest, "val")  # the other split is still fine


def test_a_rows_split_depends_on_its_key_and_seed_alone():
    from app.data.pieces import split_codes

    keys = np.arange(200_000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    codes = split_codes(keys, 0, 0.2, 0.1)
    shares = np.bincount(codes, minlength=3) / len(keys)
    assert np.abs(shares - [0.7, 0.2, 0.1]).max() < 4 * np.sqrt(0.2 * 0.8 / len(keys))
    assert (split_codes(keys[::-1], 0, 0.2, 0.1) == codes[::-1]).all()  # order does not matter
    assert (split_codes(keys, 1, 0.2, 0.1) != codes).mean() > 0.3  # the seed does


def test_a_pieces_shards_are_cut_at_the_bound_and_named_by_piece_and_order(tmp_path):
    from app.data.pieces import ShardWriter, SplitRule, Target

    schema = pa.schema([("x", pa.float64()), ("label", pa.string())])
    writer = ShardWriter(Target(str(tmp_path), "gen", 300, SplitRule(0, 0.5, 0.0)), 7, schema)
    for start in range(0, 1000, 250):
        rows = pa.table({"x": np.arange(start, start + 250, dtype=float), "label": ["a"] * 250})
        writer.add(rows, np.arange(start, start + 250, dtype=np.uint64) * np.uint64(2654435761))
    records = writer.close()
    assert sum(r.rows for r in records) == 1000 and max(r.rows for r in records) == 300
    names = [r.file for r in records if r.split == "train"]
    assert names[0] == "gen/train/part-000007-0000.parquet"
    xs = np.concatenate(
        [
            pq.read_table(tmp_path / r.file.split("/", 1)[1])["x"]
            for r in records
            if r.split == "train"
        ]
    )
    assert (np.diff(xs) > 0).all()  # the source's order within a split
