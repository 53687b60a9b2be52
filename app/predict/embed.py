"""A retrieval model's batches (jobs.predict): each row's embedding, of its picture when the
input has the model's image column, else of its caption. The input's other columns come out
beside the embedding as they are (the metadata a vector index keeps and filters by)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from app.config import Config
from app.data.kinds.image_text import (
    CAPTIONS,
    MAX_ASPECT,
    PICTURES,
    BadPicture,
    PictureLimits,
    decode,
    require,
)
from app.errors import UserError
from app.predict.actor import ArtifactBatches, good_values, outputs_table
from app.predict.rows import CheckedBatch, InputSpec, check_batch

EMBEDDING = "embedding"


class EmbeddingPredictor(ArtifactBatches):
    @staticmethod
    def input_spec(
        schema: dict[str, Any], id_column: str, fmt: str, present: list[str], config: Config
    ) -> InputSpec:
        """The column embedded: the image column if the input has it, else the caption column
        (JSON Lines, which has no header, carries captions)."""
        image, caption = schema["feature_columns"][:2]
        column = image if image in present else caption
        if column == id_column:
            raise UserError(f"--id-column {id_column!r} is the column to embed")
        width = PICTURES if column == image else CAPTIONS
        rest = tuple(c for c in present if c not in (id_column, image, column))
        limits = json.dumps({"max_image_aspect": config.data.max_image_aspect})
        return InputSpec(schema["kind"], (column,), width, id_column, fmt, rest, (), limits)  # type: ignore[arg-type]

    def __init__(self, artifact_uri: str, variant: str, threads: int, spec: InputSpec):
        super().__init__(artifact_uri, spec)
        self.pre = require(self.artifact.preprocessor)
        graph = "image" if spec.num_features == PICTURES else "text"
        self.session = self.artifact.session(variant, threads, graph)
        aspect = json.loads(spec.settings or "{}").get("max_image_aspect", MAX_ASPECT)
        self.limits = PictureLimits(max_aspect=aspect, aspect_key="data.max_image_aspect")

    def __call__(self, batch: pa.Table) -> pa.Table:
        columns, n, known, where = self.columns(batch)
        checked = check_batch(columns, n, self.spec, known)
        inputs = self._inputs(checked)  # may refuse more rows: pictures that do not decode
        vectors = self._embed(inputs)
        flat = pa.array(vectors.reshape(-1), pa.float32())
        outputs = {
            EMBEDDING: pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1]).cast(
                pa.list_(pa.float32())
            )
        }
        for name in self.spec.passthrough:
            outputs[name] = good_values(columns[name], checked.good)
        return outputs_table(columns, self.spec.id_column, checked, outputs, where, self.meta)

    def _inputs(self, checked: CheckedBatch) -> dict[str, np.ndarray]:
        if self.spec.num_features == CAPTIONS:
            return self.pre.text_features(checked.raw)
        pixels, good = [], []
        name = self.spec.feature_columns[0]
        for row, data in zip(checked.good.tolist(), checked.raw, strict=True):
            try:
                pixels.append(self.pre.picture_pixels(decode(data, self.limits)))
                good.append(row)
            except BadPicture as e:
                checked.reasons[row] = f"column {name!r}: {e}"
        checked.good = np.asarray(good, np.int64)
        return {"pixels": self.pre.stacked(pixels)}

    def _embed(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        rows = len(next(iter(inputs.values())))
        if not rows:
            return np.zeros((0, self.artifact.schema["embed_dim"]), np.float32)
        return np.asarray(self.session.run([EMBEDDING], inputs)[0], np.float32)
