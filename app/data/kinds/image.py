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
        stats = RunningStats()
        for chunk in chunks:
            stats.add(np.stack(chunk[column].to_list()).reshape(-1, 1))
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

    @classmethod
    def arrow_column(cls, name: str, values: pd.Series) -> pa.Array:
        return pixel_column(np.stack(values.to_list()))

    @classmethod
    def check_columns(
        cls, columns: dict[str, Column], names: list[str], width: int
    ) -> tuple[Any, Problems]:
        return checks.pixels(columns[names[0]], names[0], width)


def pixel_column(flat: np.ndarray) -> pa.Array:
    """Rows of flat pixels as shards store them: uint8 when every value is one (decoded
    pictures, 0..255), else float32; read back, both are float32 pixels of the same values."""
    narrow = flat.astype(np.uint8)
    if not np.array_equal(narrow, flat):
        narrow = flat.astype(np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(narrow.reshape(-1)), flat.shape[1])
