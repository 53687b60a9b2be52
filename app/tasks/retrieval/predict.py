"""A retrieval model's batches (jobs.predict): each row's embedding, of its picture when the
input has the model's image column, else of its caption. The input's other columns come out
beside the embedding as they are (the metadata a vector index keeps and filters by)."""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from app import storage
from app.config import Config, DataConfig
from app.data.checks import values_of
from app.data.kinds.image_text import (
    CAPTIONS,
    MAX_ASPECT,
    PICTURES,
    BadPicture,
    PictureLimits,
    decode,
    require,
)
from app.data.pictures import PictureReader
from app.data.preprocess import Column
from app.errors import UserError
from app.predict.actor import ArtifactBatches, PredictInput, good_values, outputs_table
from app.predict.row_checks import CheckedBatch, InputSpec, check_batch
from app.runtime.vector_index import THUMBNAIL

EMBEDDING = "embedding"


def _folder(uri: str) -> str:
    return uri.rsplit("/", 1)[0] if "://" in uri else os.path.dirname(os.path.abspath(uri))


class EmbeddingPredictor(ArtifactBatches):
    @staticmethod
    def input_spec(request: PredictInput) -> InputSpec:
        """The column embedded: the image column if the input has it (a folder of pictures
        is one), else the caption column (JSON Lines, which has no header, carries captions).
        Pictures named by path are read under the input's folder or `data.image_roots`."""
        schema, fmt, present, id_column = (
            request.schema,
            request.format,
            request.present,
            request.id_column,
        )
        image, caption = schema["feature_columns"][:2]
        column = image if image in present or fmt == "pictures" else caption
        if column == id_column:
            raise UserError(f"--id-column {id_column!r} is the column to embed")
        width = PICTURES if column == image else CAPTIONS
        rest = tuple(c for c in present if c not in (id_column, image, column))
        data, source = request.config.data, request.source
        settings = {
            "base": source if not storage.is_file(source) else _folder(source),
            "image_roots": data.image_roots,
            "max_image_bytes": data.max_image_bytes,
            "max_image_aspect": data.max_image_aspect,
            "thumbnail": thumbnail_settings(request.config) if width == PICTURES else None,
        }
        return InputSpec(
            kind=schema["kind"],
            feature_columns=(column,),
            num_features=width,
            id_column=id_column,
            format=fmt,
            passthrough=rest,
            settings=json.dumps(settings),
        )

    def __init__(self, artifact_uri: str, variant: str, threads: int, spec: InputSpec):
        super().__init__(artifact_uri, spec)
        self.pre = require(self.artifact.preprocessor)
        graph = "image" if spec.num_features == PICTURES else "text"
        self.session = self.artifact.session(variant, threads, graph)
        settings = json.loads(spec.settings or "{}")
        aspect = settings.get("max_image_aspect", MAX_ASPECT)
        self.limits = PictureLimits(max_aspect=aspect, aspect_key="data.max_image_aspect")
        self.reader = None
        if spec.num_features == PICTURES and "base" in settings:
            data = DataConfig(
                image_roots=settings["image_roots"],
                max_image_bytes=settings["max_image_bytes"],
                max_image_aspect=aspect,
            )
            self.reader = PictureReader(settings["base"], data, decoded_after=True)
        self.thumbnail = Thumbnails(**settings["thumbnail"]) if settings.get("thumbnail") else None

    def __call__(self, batch: pa.Table) -> pa.Table:
        columns, n, known, where = self.columns(batch)
        if self.reader is not None:
            name = self.spec.feature_columns[0]
            columns[name] = self._read_paths(columns[name], known)
        checked = check_batch(columns, n, self.spec, known)
        inputs, thumbnails = self._inputs(checked)  # may refuse pictures that do not decode
        vectors = self._embed(inputs)
        flat = pa.array(vectors.reshape(-1), pa.float32())
        outputs = {
            EMBEDDING: pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1]).cast(
                pa.list_(pa.float32())
            )
        }
        for name in self.spec.passthrough:
            outputs[name] = good_values(columns[name], checked.good)
        if self.thumbnail is not None:
            outputs[THUMBNAIL] = pa.array(thumbnails, pa.binary())
        return outputs_table(columns, self.spec.id_column, checked, outputs, where, self.meta)

    def _read_paths(self, column: Column, known: list[str | None]) -> list[Any]:
        """A picture named by path (text; any value of a CSV, JSON Lines or a folder of
        pictures) read where it may be (`PictureReader`); bytes in Parquet are the picture
        itself. A picture that cannot be read is its row's problem."""
        assert self.reader is not None
        name = self.spec.feature_columns[0]
        named = self.spec.format != "parquet"
        out: list[Any] = []
        for i, value in enumerate(values_of(column)):
            if isinstance(value, bytes | bytearray) and named:
                value = bytes(value).decode("utf-8", errors="replace")
            if not isinstance(value, str):
                out.append(value)
                continue
            data, problem = self.reader.read(value)
            if problem and known[i] is None:
                known[i] = f"column {name!r}: {problem}"
            out.append(data)
        return out

    def _inputs(self, checked: CheckedBatch) -> tuple[dict[str, np.ndarray], list[bytes | None]]:
        """The graph's inputs for the good rows, and their thumbnails when asked for."""
        if self.spec.num_features == CAPTIONS:
            return self.pre.text_features(checked.raw), []
        pixels, good, thumbnails = [], [], []
        name = self.spec.feature_columns[0]
        for row, data in zip(checked.good.tolist(), checked.raw, strict=True):
            try:
                picture = decode(data, self.limits)
                pixels.append(self.pre.picture_pixels(picture))
                good.append(row)
            except BadPicture as e:
                checked.reasons[row] = f"column {name!r}: {e}"
                continue
            if self.thumbnail is not None:
                thumbnails.append(self.thumbnail.of(picture))
        checked.good = np.asarray(good, np.int64)
        return {"pixels": self.pre.stacked(pixels)}, thumbnails

    def _embed(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        rows = len(next(iter(inputs.values())))
        if not rows:
            return np.zeros((0, self.artifact.schema["embed_dim"]), np.float32)
        return np.asarray(self.session.run([EMBEDDING], inputs)[0], np.float32)


def thumbnail_settings(config: Config) -> dict[str, int] | None:
    cfg = config.index
    return (
        {"px": cfg.thumbnail_px, "max_bytes": cfg.max_thumbnail_bytes} if cfg.thumbnails else None
    )


@dataclass(frozen=True)
class Thumbnails:
    """A picture's JPEG thumbnail, longest side at most `px`; None when even a plain one is
    over `max_bytes` (the page shows the item without it)."""

    px: int
    max_bytes: int

    def of(self, picture: np.ndarray) -> bytes | None:
        from PIL import Image

        image = Image.fromarray(picture)
        image.thumbnail((self.px, self.px))
        for quality in (85, 60, 35):
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", quality=quality)
            if buffer.tell() <= self.max_bytes:
                return buffer.getvalue()
        return None
