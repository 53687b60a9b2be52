"""The sources one task makes whole: scikit-learn's bundled sets (real data that ships with the
package) and deterministic generators (`synthetic_*`, `data.num_rows` rows), prepared like every
source (app/data/pieces.py) as one piece.

Each is a sequential generator: its task makes the rows batch by batch from one seeded random
stream and streams them into shards, so no process holds the source. A row's split is a pure
function of (`data.seed`, its key): its number in the source, or for pictures and captions its
picture's (with its twin). Row values stay raw (pixels, numbers, text, label names): every
transform belongs to the fitted preprocessor, so that serving accepts exactly what the source
held.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa

from app.config import Config, DataConfig
from app.data.kinds import processor
from app.data.pieces import PieceResult, ShardWriter, SourcePlan, Target, Tasks
from app.data.preprocess import Preprocessor

# "tokens": a text corpus packed into token rows for language modelling (app/data/text_files.py).
# "image_text": pictures and their captions (retrieval; no labels).
Kind = Literal["image", "tabular", "text", "tokens", "image_text"]
IMAGE_COLUMN = "image"
TEXT_COLUMN = "text"
BATCH_ROWS = 1024  # rows a generator makes before they are written
Batches = Iterator[tuple[pd.DataFrame, np.ndarray]]  # rows and each row's split key


@dataclass(frozen=True)
class Made:
    """What a made source's rows hold, and the generator its task runs (a module-level
    function, so it pickles)."""

    kind: Kind
    features: tuple[str, ...]
    label: str
    schema: pa.Schema
    rows: Callable[[DataConfig], Batches]
    description: dict[str, Any]
    image_shape: tuple[int, int, int] | None = None
    declared: tuple[str, ...] | None = None  # data.labels: a label outside them is refused


def planned(config: Config, tasks: Tasks, folder: str) -> SourcePlan:
    cfg = config.data
    made = MAKERS[cfg.source](cfg)
    return SourcePlan(
        kind=made.kind,
        features=made.features,
        label=made.label,
        schema=made.schema,
        pieces=[cfg],
        run=functools.partial(make_rows, made=made),
        description=made.description,
        image_shape=made.image_shape,
    )


def make_rows(cfg: DataConfig, target: Target, made: Made) -> PieceResult:
    """The source's rows made, batch by batch, and written to their splits' shards."""
    out = PieceResult(0)
    writer = ShardWriter(target, 0, made.schema)
    labels: set[str] = set()
    for frame, keys in made.rows(cfg):
        if made.label:
            values = frame[made.label].astype(str)
            allowed = values.unique() if made.declared is None else made.declared
            outside = np.flatnonzero(~values.isin(allowed).to_numpy())
            if len(outside):
                out.problem = (
                    f"column {made.label!r}: label {values.iloc[outside[0]]!r} at row "
                    f"{out.rows + int(outside[0])} is not in data.labels {list(allowed)}"
                )
                return out
            labels.update(values.unique())
        out.rows += len(frame)
        writer.add(to_arrow(frame, made), keys)
    out.shards = writer.close()
    out.labels = sorted(labels)
    return out


def to_arrow(frame: pd.DataFrame, made: Made) -> pa.Table:
    """The rows as their shards store them: feature columns as their kind encodes them, the
    label column as it is."""
    kind = processor(made.kind)
    columns = {c: kind.arrow_column(c, frame[c]) for c in made.features}
    if made.label:
        columns[made.label] = Preprocessor.arrow_column(made.label, frame[made.label])
    return pa.table(columns).cast(made.schema)


def numbered(start: int, count: int) -> np.ndarray:
    return np.arange(start, start + count, dtype=np.uint64)


# --- scikit-learn's bundled datasets (real data that ships with the package) -------------------


def _sklearn(cfg: DataConfig) -> Made:
    """Planning reads the set's column names (scikit-learn loads it whole: 1,797 rows at most)."""
    description = {"source": cfg.source, "origin": f"sklearn.datasets.load_{cfg.source}"}
    label, declared = cfg.label_column, _declared(cfg)
    if cfg.source == "digits":
        # 8x8 grey images, pixel values 0..16, kept flat as the source holds them.
        schema = pa.schema([(IMAGE_COLUMN, pa.large_binary()), (label, pa.string())])
        return Made(
            "image", (IMAGE_COLUMN,), label, schema, _sklearn_rows, description, (1, 8, 8), declared
        )
    columns = tuple(_column_name(n) for n in _bunch(cfg.source).feature_names)
    schema = pa.schema([*((c, pa.float64()) for c in columns), (label, pa.string())])
    return Made("tabular", columns, label, schema, _sklearn_rows, description, None, declared)


def _sklearn_rows(cfg: DataConfig) -> Batches:
    bunch = _bunch(cfg.source)
    names = [str(n) for n in bunch.target_names]
    labels = [names[t] for t in bunch.target]
    if cfg.source == "digits":
        frame = pd.DataFrame({IMAGE_COLUMN: list(bunch.data.astype(np.float32))})
    else:
        frame = pd.DataFrame(bunch.data, columns=[_column_name(n) for n in bunch.feature_names])
    frame[cfg.label_column] = labels
    yield frame, numbered(0, len(frame))


def _bunch(source: str) -> Any:
    from sklearn import datasets

    return getattr(datasets, f"load_{source}")()


def _column_name(name: str) -> str:
    return "_".join(name.replace("/", " ").replace("(", " ").replace(")", " ").split())


def _declared(cfg: DataConfig) -> tuple[str, ...] | None:
    return tuple(cfg.labels) if cfg.labels is not None else None


# --- deterministic generators: learnable but not trivial ---------------------------------------

FILLER = [f"w{i}" for i in range(300)]


def batched(rows: Iterator[tuple[Any, str]], column: str, label: str) -> Batches:
    """(value, label) rows in frames of BATCH_ROWS, each row keyed by its number."""
    start, values, labels = 0, [], []
    for value, name in rows:
        values.append(value)
        labels.append(name)
        if len(values) == BATCH_ROWS:
            yield pd.DataFrame({column: values, label: labels}), numbered(start, len(values))
            start, values, labels = start + len(values), [], []
    if values:
        yield pd.DataFrame({column: values, label: labels}), numbered(start, len(values))


def _synthetic_text_rows(cfg: DataConfig) -> Batches:
    return batched(_sentences(cfg), TEXT_COLUMN, cfg.label_column)


def _sentences(cfg: DataConfig) -> Iterator[tuple[str, str]]:
    """Sentences of filler words with topic keywords; one topic per class, some negated.

    Each class owns 12 keywords; a sentence carries 1-3 of its own class's keywords and, in
    30% of rows, one keyword of another class negated by a preceding "without". Counting keywords
    (a bag of words) must guess when the negated one ties the real one (about 12% of rows);
    reading "without X" in context gets every row right.
    """
    rng = np.random.default_rng(cfg.seed)
    k = cfg.num_classes
    keywords = [[f"topic{c}_{j}" for j in range(12)] for c in range(k)]
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
        yield " ".join(words), f"class_{c}"


def _synthetic_image_rows(cfg: DataConfig) -> Batches:
    return batched(_bars(cfg), IMAGE_COLUMN, cfg.label_column)


def _bars(cfg: DataConfig) -> Iterator[tuple[np.ndarray, str]]:
    """Grey images with a class-specific oriented bar at a random offset, plus noise (0..255)."""
    rng = np.random.default_rng(cfg.seed)
    size, k = cfg.image_size, cfg.num_classes
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    for _ in range(cfg.num_rows):
        c = int(rng.integers(k))
        angle = np.pi * c / k
        cx, cy = rng.uniform(size * 0.3, size * 0.7, size=2)
        dist = np.abs((xx - cx) * np.sin(angle) - (yy - cy) * np.cos(angle))
        img = 200.0 * (dist < size / 10) + rng.normal(30, 25, size=(size, size))
        yield np.clip(img, 0, 255).astype(np.uint8).reshape(-1), f"class_{c}"


def _synthetic_text(cfg: DataConfig) -> Made:
    schema = pa.schema([(TEXT_COLUMN, pa.string()), (cfg.label_column, pa.string())])
    description = {"source": "synthetic_text", "seed": cfg.seed, "num_rows": cfg.num_rows}
    return Made(
        "text",
        (TEXT_COLUMN,),
        cfg.label_column,
        schema,
        _synthetic_text_rows,
        description,
        declared=_declared(cfg),
    )


def _synthetic_image(cfg: DataConfig) -> Made:
    schema = pa.schema([(IMAGE_COLUMN, pa.large_binary()), (cfg.label_column, pa.string())])
    description = {"source": "synthetic_image", "seed": cfg.seed, "num_rows": cfg.num_rows}
    size = cfg.image_size
    return Made(
        "image",
        (IMAGE_COLUMN,),
        cfg.label_column,
        schema,
        _synthetic_image_rows,
        description,
        (1, size, size),
        _declared(cfg),
    )


# --- pictures and captions (retrieval) -----------------------------------------------------------


def _image_text(cfg: DataConfig) -> Made:
    """Generated scenes (pictures of your own are prepared in pieces:
    app/data/image_text_source.py)."""
    from app.data.pictures import CAPTION, IMAGE, IMAGE_ID, TWIN

    description = {
        "source": "synthetic_image_text",
        "seed": cfg.seed,
        "pictures": cfg.num_rows,
        "image_size": cfg.image_size,
        "captions_per_image": cfg.captions_per_image,
    }
    columns = (IMAGE, CAPTION, IMAGE_ID, TWIN)
    schema = pa.schema([(c, pa.binary() if c == IMAGE else pa.string()) for c in columns])
    shape = (3, cfg.image_size, cfg.image_size)
    return Made("image_text", columns, "", schema, _image_text_rows, description, shape)


def _image_text_rows(cfg: DataConfig) -> Batches:
    from app.data.pictures import synthetic

    yield from synthetic(cfg)


MAKERS: dict[str, Callable[[DataConfig], Made]] = {
    "digits": _sklearn,
    "breast_cancer": _sklearn,
    "wine": _sklearn,
    "synthetic_text": _synthetic_text,
    "synthetic_image": _synthetic_image,
    "synthetic_image_text": _image_text,
}
