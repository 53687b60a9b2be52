"""Images: one column of flat pixel values (channels, height, width in the manifest; stored as
uint8 when they are bytes), scaled by the train split's mean and std, or a pretrained model's
own image processor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from app.data import checks
from app.data.preprocess import Column, FitOptions, Preprocessor, Problems, RunningStats


class Image(Preprocessor):
    kind = "image"
    input_name = "image"

    def __init__(self, state: dict[str, Any]):
        super().__init__(state)
        self.shape: list[int] = state["image_shape"]
        self._processor = None
        if "image_processor" in state:  # a pretrained image model's own resize and normalize
            from app.data.images import ImageProcessor

            self._processor = ImageProcessor(state["image_processor"])
        self._mean = np.float32(state.get("mean", 0.0))
        self._std = np.float32(state.get("std", 1.0))

    @classmethod
    def fit_state(
        cls, chunks: Iterator[pd.DataFrame], manifest: dict[str, Any], options: FitOptions
    ) -> dict[str, Any]:
        column = manifest["feature_columns"][0]
        state: dict[str, Any] = {"image_shape": manifest["image_shape"]}
        if options.base is not None:
            state["image_processor"] = options.base.image_processor()
            for _ in chunks:
                pass
            return state
        stats, width = RunningStats(), int(np.prod(manifest["image_shape"]))
        for chunk in chunks:
            stats.add(stored_pixels(chunk[column], width).reshape(-1, 1))
        mean, std = stats.result()
        return state | {"mean": float(mean[0]), "std": float(std[0])}

    @property
    def num_features(self) -> int:
        return int(np.prod(self.shape))

    def row_bytes(self) -> int:
        if self._processor is not None:
            return 4 * int(np.prod(self._processor.output_shape)) + 8
        return super().row_bytes()

    def features(self, raw: Any) -> dict[str, np.ndarray]:
        pixels = np.asarray(raw, dtype=np.float32).reshape(-1, *self.shape)
        if self._processor is not None:
            return {"x": self._processor(pixels)}
        return {"x": ((pixels - self._mean) / self._std).astype(np.float32)}

    def raw_features(self, batch: dict[str, np.ndarray] | pd.DataFrame) -> Any:
        return stored_pixels(batch[self.feature_columns[0]], self.num_features)

    @classmethod
    def arrow_column(cls, name: str, values: pd.Series) -> pa.Array:
        return pixel_column(np.stack(values.to_list()))

    @classmethod
    def sample_tensor(cls, frame: pd.DataFrame, columns: list[str]) -> dict[str, Any]:
        rows = [stored_pixels([value], len(value))[0] for value in frame[columns[0]]]
        data = [row.tolist() for row in rows]
        return {
            "name": cls.input_name,
            "datatype": "FP32",
            "shape": [len(data), len(data[0])],
            "data": data,
        }

    @classmethod
    def check_columns(
        cls, columns: dict[str, Column], names: list[str], width: int
    ) -> tuple[Any, Problems]:
        return checks.pixels(columns[names[0]], names[0], width)


def pixel_column(flat: np.ndarray) -> pa.Array:
    """Rows of flat pixels as shards store them: each row's bytes, uint8 when every value is one
    (decoded pictures), else float32. A binary value a row, not a list of numbers: Parquet
    writes and reads it some 20x faster (a list's every element carries its own levels)."""
    narrow = flat.astype(np.uint8)
    rows = narrow if np.array_equal(narrow, flat) else flat.astype(np.float32)
    data = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
    width = data.size // max(len(rows), 1)
    offsets = np.arange(len(rows) + 1, dtype=np.int64) * width
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    return pa.Array.from_buffers(pa.large_binary(), len(rows), buffers)


def stored_pixels(values: Any, width: int) -> np.ndarray:
    """Stored rows (each its pixels' bytes: uint8, or float32 at four bytes a value; or rows
    of numbers, as a source holds them before they are stored) as float32 [rows, width]."""
    rows = list(values)
    if not rows:
        return np.zeros((0, width), np.float32)
    if not isinstance(rows[0], bytes | bytearray | memoryview):
        return np.stack(rows).astype(np.float32).reshape(len(rows), width)
    if all(len(r) == width for r in rows):
        flat = np.frombuffer(b"".join(rows), np.uint8)
    else:
        flat = np.frombuffer(b"".join(rows), np.float32)
    return flat.reshape(len(rows), width).astype(np.float32)
