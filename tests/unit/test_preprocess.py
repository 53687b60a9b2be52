"""app/data/preprocess.py: fit from chunks (train only), transform, JSON round trip, labels, text lengths."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from app.data import kinds
from app.data.ingest import iter_shards
from app.data.kinds.image import stored_pixels
from app.data.kinds.text import PAD
from app.data.prepare import read_manifest, split_files
from app.data.preprocess import LABEL_KEY, FitOptions
from app.errors import UserError
from app.pipeline.stages import prepare
from app.train.preprocessing import fit_preprocessor
from tests.unit.unit_helpers import read_split

pytestmark = pytest.mark.unit

IMAGE_MANIFEST = {
    "kind": "image",
    "feature_columns": ["image"],
    "label_column": "label",
    "image_shape": [1, 2, 3],
}
TABLE_MANIFEST = {"kind": "tabular", "feature_columns": ["a", "b", "c"], "label_column": "y"}
TEXT_MANIFEST = {"kind": "text", "feature_columns": ["text"], "label_column": "label"}


def image_chunks(seed: int = 0) -> list[pd.DataFrame]:
    rng = np.random.default_rng(seed)
    return [
        pd.DataFrame(
            {"image": list(rng.integers(0, 256, size=(n, 6)).astype(np.float32)), "label": labels}
        )
        for n, labels in ((3, ["b", "a", "b"]), (2, ["c", "a"]))
    ]


def table_chunks() -> list[pd.DataFrame]:
    rng = np.random.default_rng(1)
    return [
        pd.DataFrame(
            {
                "a": rng.normal(5, 2, n),
                "b": rng.uniform(-1, 1, n),
                "c": np.full(n, 7.0),
                "y": labels,
            }
        )
        for n, labels in ((4, ["no", "yes", "no", "no"]), (3, ["yes", "no", "yes"]))
    ]


TEXTS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the cat and the dog",
    "birds fly over the park",
]


def text_chunks() -> list[pd.DataFrame]:
    return [
        pd.DataFrame({"text": TEXTS[:2], "label": ["cat", "dog"]}),
        pd.DataFrame({"text": TEXTS[2:], "label": ["cat", "bird"]}),
    ]


def as_batch(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    return {c: frame[c].to_numpy() for c in frame.columns}


# --- fitting on each kind -----------------------------------------------------------------------


def test_image_fit_uses_one_mean_and_std_over_all_pixels():
    chunks = image_chunks()
    pre = kinds.fit(iter(chunks), IMAGE_MANIFEST, FitOptions())
    pixels = np.concatenate([np.stack(c["image"].to_list()) for c in chunks])
    assert pre.kind == "image"
    assert pre.state["mean"] == pytest.approx(pixels.mean())
    assert pre.state["std"] == pytest.approx(pixels.std())
    assert pre.labels == ["a", "b", "c"]
    out = pre.transform_batch(as_batch(chunks[0]))
    assert out["x"].shape == (3, 1, 2, 3) and out["x"].dtype == np.float32
    expected = (np.stack(chunks[0]["image"].to_list()) - pixels.mean()) / pixels.std()
    np.testing.assert_allclose(out["x"].reshape(3, 6), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[LABEL_KEY], [1, 0, 1])


def test_tabular_fit_standardises_each_column():
    chunks = table_chunks()
    pre = kinds.fit(iter(chunks), TABLE_MANIFEST, FitOptions())
    values = pd.concat(chunks)[["a", "b", "c"]].to_numpy()
    np.testing.assert_allclose(pre.state["mean"], values.mean(0))
    np.testing.assert_allclose(pre.state["std"][:2], values.std(0)[:2])
    assert pre.state["std"][2] == 1.0  # a constant column is not divided by zero
    out = pre.transform_batch(as_batch(pd.concat(chunks)))
    assert out["x"].shape == (7, 3)
    np.testing.assert_allclose(out["x"][:, :2].mean(0), 0, atol=1e-6)
    np.testing.assert_allclose(out["x"][:, :2].std(0), 1, atol=1e-5)
    np.testing.assert_allclose(out["x"][:, 2], 0, atol=1e-6)
    assert pre.labels == ["no", "yes"]
    np.testing.assert_array_equal(out[LABEL_KEY], [0, 1, 0, 0, 1, 0, 1])


def test_chunked_fit_equals_one_chunk_fit():
    chunks = table_chunks()
    chunked = kinds.fit(iter(chunks), TABLE_MANIFEST, FitOptions())
    whole = kinds.fit(iter([pd.concat(chunks)]), TABLE_MANIFEST, FitOptions())
    np.testing.assert_allclose(chunked.state["mean"], whole.state["mean"])
    np.testing.assert_allclose(chunked.state["std"], whole.state["std"])


def test_text_pads_and_truncates_to_max_length():
    pre = kinds.fit(iter(text_chunks()), TEXT_MANIFEST, FitOptions(max_length=6, vocab_size=100))
    assert pre.labels == ["bird", "cat", "dog"]
    out = pre.features(["the cat", "the cat and the dog sat on the mat in the park", ""])
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.shape == mask.shape == (3, 6)
    assert ids.dtype == mask.dtype == np.int64
    np.testing.assert_array_equal(mask[0], [1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(mask[1], [1] * 6)
    np.testing.assert_array_equal(mask[2], [0] * 6)
    pad_id = pre.tokenizer.token_to_id(PAD)
    assert pad_id == 0
    assert (ids[mask == 0] == pad_id).all()
    assert (ids[mask == 1] != pad_id).all()
    # Same words -> same ids wherever they appear (and case is normalised).
    again = pre.features(["THE Cat"])["input_ids"]
    np.testing.assert_array_equal(again[0, :2], ids[0, :2])
    assert 0 < pre.vocab_size <= 100
    batch = pre.transform_batch(as_batch(text_chunks()[0]))
    assert set(batch) == {"input_ids", "attention_mask", LABEL_KEY}
    np.testing.assert_array_equal(batch[LABEL_KEY], [1, 2])


# --- JSON round trip ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("manifest", "chunks"),
    [(IMAGE_MANIFEST, image_chunks), (TABLE_MANIFEST, table_chunks), (TEXT_MANIFEST, text_chunks)],
    ids=["image", "tabular", "text"],
)
def test_json_round_trip_transforms_identically(manifest, chunks):
    pre = kinds.fit(iter(chunks()), manifest, FitOptions(max_length=8, vocab_size=64))
    text = pre.to_json()
    again = kinds.from_json(text)
    assert again.to_json() == text
    assert again.labels == pre.labels
    assert again.input_names() == pre.input_names()
    for chunk in chunks():
        a, b = pre.transform_batch(as_batch(chunk)), again.transform_batch(as_batch(chunk))
        assert set(a) == set(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_object_array_rows_are_stacked():
    # Ray Data hands list columns over as an object array of per-row arrays.
    pre = kinds.fit(iter(image_chunks()), IMAGE_MANIFEST, FitOptions())
    chunk = image_chunks()[0]
    column = np.empty(3, dtype=object)
    for i, row in enumerate(chunk["image"]):
        column[i] = np.asarray(row)
    a = pre.transform_batch({"image": column, "label": chunk["label"].to_numpy()})
    b = pre.transform_batch(as_batch(chunk))
    np.testing.assert_array_equal(a["x"], b["x"])


# --- labels -------------------------------------------------------------------------------------


def test_unseen_label_is_refused_by_name():
    pre = kinds.fit(iter(table_chunks()), TABLE_MANIFEST, FitOptions())
    with pytest.raises(UserError, match="'maybe'") as info:
        pre.label_indices(["yes", "no", "maybe"])
    assert "row 2" in str(info.value)


def test_empty_train_split_is_refused():
    empty = pd.DataFrame({"a": [], "b": [], "c": [], "y": []})
    with pytest.raises(UserError, match="empty"):
        kinds.fit(iter([empty]), TABLE_MANIFEST, FitOptions())


def test_fitted_on_train_split_only(config_factory):
    config = config_factory("data.source=breast_cancer")
    prepare(config)
    manifest = read_manifest(config.data_output)
    pre = fit_preprocessor(config)
    train = read_split(config.data_output, manifest, "train")
    both = pd.concat([train, read_split(config.data_output, manifest, "val")])
    features = manifest.feature_columns
    np.testing.assert_allclose(pre.state["mean"], train[features].to_numpy().mean(0), rtol=1e-9)
    assert not np.allclose(pre.state["mean"], both[features].to_numpy().mean(0), rtol=1e-9, atol=0)
    # Streaming helper reads exactly the train shards.
    assert sum(
        len(f) for f in iter_shards(split_files(config.data_output, manifest, "train"))
    ) == len(train)


def test_labels_come_from_train_and_val_only_label_is_refused(config_factory, tmp_path):
    import pyarrow as pa

    from app.data.pieces import SplitRule, row_keys

    n = 20
    rare = pa.table({"a": np.arange(n, dtype=float), "label": ["rare"] * n})
    codes = SplitRule(0, 0.2, 0.0).codes(row_keys(rare, ["a", "label"]))
    labels = ["common"] * n
    labels[int(np.flatnonzero(codes == 1)[0])] = "rare"  # a row whose split (by key) is val
    path = tmp_path / "t.csv"
    pd.DataFrame({"a": np.arange(n, dtype=float), "label": labels}).to_csv(path, index=False)
    config = config_factory("data.source=table", f"data.path={path}")
    prepare(config)
    manifest = read_manifest(config.data_output)
    assert "rare" in manifest.label_names
    pre = fit_preprocessor(config, manifest)
    assert pre.labels == ["common"]
    val = read_split(config.data_output, manifest, "val")
    with pytest.raises(UserError, match="'rare'"):
        pre.transform_batch(as_batch(val))


def test_digits_preprocessor_from_prepared_shards(config_factory):
    config = config_factory()
    prepare(config)
    pre = fit_preprocessor(config)
    assert pre.kind == "image" and pre.state["image_shape"] == [1, 8, 8]
    assert pre.labels == [str(d) for d in range(10)]
    assert pre.num_features == 64
    manifest = read_manifest(config.data_output)
    train = read_split(config.data_output, manifest, "train")
    pixels = stored_pixels(train["image"], 64)
    assert pre.state["mean"] == pytest.approx(pixels.mean())
    out = pre.transform_batch(as_batch(train.iloc[:5]))
    assert out["x"].shape == (5, 1, 8, 8)


def test_text_is_cut_before_tokenizing_without_changing_its_tokens():
    """A 4 MiB text is never tokenized whole (its cost is its first few thousand characters),
    and the cut never changes the ids of the max_length tokens that are kept."""
    import time

    from app.data.kinds.text import text_char_bound

    pre = kinds.fit(iter(text_chunks()), TEXT_MANIFEST, FitOptions(max_length=16, vocab_size=100))
    bound = text_char_bound(pre.tokenizer, 16)
    long_text = "the cat sat   on the mat " * 4000  # 100k characters
    assert bound is not None and bound < 10_000 < len(long_text)
    whole = pre.tokenizer.encode(long_text)  # the same truncating tokenizer, uncut input
    assert pre.features([long_text])["input_ids"][0].tolist() == whole.ids
    start = time.perf_counter()
    pre.features(["the dog " * (2**19)])  # 4 MiB
    assert time.perf_counter() - start < 1.0  # a loose bound; tokenizing it whole takes seconds


def test_stored_pixels_round_trip_and_jobs_predict_reads_prepared_rows():
    """A row's pixels are stored as its bytes (uint8 where they are bytes, else float32) and
    read back as the same float32 values; a prepared shard's rows are a valid predict input,
    beside CSV's JSON lists, and bytes of the wrong length are refused by row."""
    import pyarrow as pa

    from app.data import checks
    from app.data.kinds.image import pixel_column

    whole = np.arange(12, dtype=np.float32).reshape(2, 6) * 20
    fractional = whole + 0.5
    for rows, kind in ((whole, pa.large_binary()), (fractional, pa.large_binary())):
        column = pixel_column(rows)
        assert column.type == kind and len(column[0].as_py()) == (6 if rows is whole else 24)
        np.testing.assert_array_equal(stored_pixels(column.to_pylist(), 6), rows)
    stored = pixel_column(whole).to_pylist()
    values = [*stored, b"[1, 2, 3, 4, 5, 6]", b"\x01\x02"]
    out, problems = checks.pixels(pa.chunked_array([pa.array(values, pa.binary())]), "image", 6)
    np.testing.assert_array_equal(out[:2], whole)
    np.testing.assert_array_equal(out[2], [1, 2, 3, 4, 5, 6])
    assert problems == {3: "column 'image': not a list of 6 numbers"}
