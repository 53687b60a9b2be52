"""Raw data sources: each returns the source's rows unchanged plus what describes them.

Row values stay raw (pixels, numbers, text, label names): every transform belongs to the fitted
preprocessor, so that serving accepts exactly what the source held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from app.config import DataConfig
from app.data.kinds import processor
from app.errors import UserError

# "tokens": a text corpus packed into token rows for language modelling (app/data/corpus.py).
# "image_text": pictures and their captions (retrieval; no labels).
Kind = Literal["image", "tabular", "text", "tokens", "image_text"]
IMAGE_COLUMN = "image"
TEXT_COLUMN = "text"


@dataclass
class SourceData:
    frame: pd.DataFrame  # feature columns + data.label_column
    kind: Kind
    feature_columns: list[str]
    label_column: str
    image_shape: tuple[int, int, int] | None = None  # (channels, height, width) of flat pixels
    description: dict[str, Any] = field(default_factory=dict)
    # Rows that must stay in one split (a picture's captions): one group number per row.
    groups: np.ndarray | None = None
    # A source's own split of its rows (the Karpathy split): split -> row indices.
    fixed_splits: dict[str, np.ndarray] | None = None
    skipped: int = 0  # rows left out (data.skip_bad_rows)


def load_source(cfg: DataConfig) -> SourceData:
    loaders = {
        "digits": _sklearn,
        "breast_cancer": _sklearn,
        "wine": _sklearn,
        "synthetic_text": _synthetic_text,
        "synthetic_image": _synthetic_image,
        "synthetic_image_text": _image_text,
    }
    if cfg.source not in loaders:
        raise UserError(f"data.source {cfg.source!r} is read in pieces by jobs.prepare, not whole")
    data = loaders[cfg.source](cfg)
    if data.frame.empty:
        raise UserError(f"data source {cfg.source!r} produced no rows")
    if processor(data.kind).labelled:  # pictures and captions have no labels
        _check_labels(data, cfg.labels)
    return data


def _check_labels(data: SourceData, declared: list[str] | None) -> None:
    labels = data.frame[data.label_column]
    if labels.isna().any():
        row = int(np.flatnonzero(labels.isna().to_numpy())[0])
        where = data.frame.attrs.get("row_origin", {}).get(row, f"row {row}")
        raise UserError(f"column {data.label_column!r}: missing label at {where}")
    if declared is None:
        return
    bad = ~labels.astype(str).isin(declared)
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        where = data.frame.attrs.get("row_origin", {}).get(row, f"row {row}")
        raise UserError(
            f"column {data.label_column!r}: label {labels.iloc[row]!r} at {where} is not in "
            f"data.labels {declared}"
        )


# --- scikit-learn's bundled datasets (real data that ships with the package) -------------------


def _sklearn(cfg: DataConfig) -> SourceData:
    from sklearn import datasets

    bunch = getattr(datasets, f"load_{cfg.source}")()
    names = [str(n) for n in bunch.target_names]
    labels = [names[t] for t in bunch.target]
    description = {"source": cfg.source, "origin": f"sklearn.datasets.load_{cfg.source}"}
    if cfg.source == "digits":
        # 8x8 grey images, pixel values 0..16, kept flat as the source holds them.
        pixels = bunch.data.astype(np.float32)
        frame = pd.DataFrame({IMAGE_COLUMN: list(pixels), cfg.label_column: labels})
        return SourceData(frame, "image", [IMAGE_COLUMN], cfg.label_column, (1, 8, 8), description)
    columns = [_column_name(n) for n in bunch.feature_names]
    frame = pd.DataFrame(bunch.data, columns=columns)
    frame[cfg.label_column] = labels
    return SourceData(frame, "tabular", columns, cfg.label_column, None, description)


def _column_name(name: str) -> str:
    return "_".join(name.replace("/", " ").replace("(", " ").replace(")", " ").split())


# --- deterministic generators: learnable but not trivial ---------------------------------------

FILLER = [f"w{i}" for i in range(300)]


def _synthetic_text(cfg: DataConfig) -> SourceData:
    """Sentences of filler words with topic keywords; one topic per class, some negated.

    Each class owns 12 keywords; a sentence carries 1-3 of its own class's keywords and, in
    30% of rows, one keyword of another class negated by a preceding "without". Counting keywords
    (a bag of words) must guess when the negated one ties the real one (about 12% of rows);
    reading "without X" in context gets every row right.
    """
    rng = np.random.default_rng(cfg.seed)
    k = cfg.num_classes
    keywords = [[f"topic{c}_{j}" for j in range(12)] for c in range(k)]
    texts, labels = [], []
    for _ in range(cfg.num_rows):
        c = int(rng.integers(k))
        words = [str(w) for w in rng.choice(FILLER, size=int(rng.integers(4, 14)))]
        phrases = [
            [str(w)]
            for w in rng.choice(keywords[c], size=int(rng.choice([1, 2, 3], p=[0.4, 0.4, 0.2])))
        ]
        if rng.random() < 0.3:
            other = int((c + rng.integers(1, k)) % k)
            phrases.append(["without", str(rng.choice(keywords[other]))])
        for phrase in phrases:
            at = int(rng.integers(len(words) + 1))
            words[at:at] = phrase
        texts.append(" ".join(words))
        labels.append(f"class_{c}")
    frame = pd.DataFrame({TEXT_COLUMN: texts, cfg.label_column: labels})
    description = {"source": "synthetic_text", "seed": cfg.seed, "num_rows": cfg.num_rows}
    return SourceData(frame, "text", [TEXT_COLUMN], cfg.label_column, None, description)


def _synthetic_image(cfg: DataConfig) -> SourceData:
    """Grey images with a class-specific oriented bar at a random offset, plus noise (0..255)."""
    rng = np.random.default_rng(cfg.seed)
    size, k = cfg.image_size, cfg.num_classes
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    rows, labels = [], []
    for _ in range(cfg.num_rows):
        c = int(rng.integers(k))
        angle = np.pi * c / k
        cx, cy = rng.uniform(size * 0.3, size * 0.7, size=2)
        dist = np.abs((xx - cx) * np.sin(angle) - (yy - cy) * np.cos(angle))
        img = 200.0 * (dist < size / 10) + rng.normal(30, 25, size=(size, size))
        rows.append(np.clip(img, 0, 255).astype(np.uint8).reshape(-1).astype(np.float32))
        labels.append(f"class_{c}")
    frame = pd.DataFrame({IMAGE_COLUMN: rows, cfg.label_column: labels})
    description = {"source": "synthetic_image", "seed": cfg.seed, "num_rows": cfg.num_rows}
    return SourceData(
        frame, "image", [IMAGE_COLUMN], cfg.label_column, (1, size, size), description
    )


# --- pictures and captions (retrieval) -----------------------------------------------------------


def _image_text(cfg: DataConfig) -> SourceData:
    """Generated scenes (pictures of your own are prepared in pieces:
    app/data/image_text_source.py)."""
    from app.data import pictures

    frame, description = pictures.synthetic(cfg)
    shape = (3, cfg.image_size, cfg.image_size)
    return SourceData(
        frame,
        "image_text",
        list(frame.columns),
        "",
        shape,
        description,
        groups=pictures.groups(frame),
    )
