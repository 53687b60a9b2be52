"""Tabular rows: named numeric columns, standardised with the train split's mean and std."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from app.data import checks
from app.data.preprocess import Column, FitOptions, Preprocessor, Problems, RunningStats


class Tabular(Preprocessor):
    kind = "tabular"

    def __init__(self, state: dict[str, Any]):
        super().__init__(state)
        self._mean = np.asarray(state["mean"], dtype=np.float32)
        self._std = np.asarray(state["std"], dtype=np.float32)

    @classmethod
    def fit_state(
        cls, chunks: Iterator[pd.DataFrame], manifest: dict[str, Any], options: FitOptions
    ) -> dict[str, Any]:
        stats = RunningStats()
        for chunk in chunks:
            stats.add(chunk[manifest["feature_columns"]].to_numpy(dtype=np.float64))
        mean, std = stats.result()
        return {"mean": mean.tolist(), "std": std.tolist()}

    @property
    def num_features(self) -> int:
        return len(self.feature_columns)

    def features(self, raw: Any) -> dict[str, np.ndarray]:
        x = (
            np.asarray(raw, dtype=np.float32).reshape(-1, self.num_features) - self._mean
        ) / self._std
        return {"x": x.astype(np.float32)}

    def raw_features(self, batch: dict[str, np.ndarray] | pd.DataFrame) -> Any:
        return np.stack(
            [np.asarray(batch[c], dtype=np.float32) for c in self.feature_columns], axis=1
        )

    @classmethod
    def sample_tensor(cls, frame: pd.DataFrame, columns: list[str]) -> dict[str, Any]:
        values = frame[columns].to_numpy().tolist()
        shape = [len(values), len(columns)]
        return {"name": cls.input_name, "datatype": "FP32", "shape": shape, "data": values}

    @classmethod
    def check_columns(
        cls, columns: dict[str, Column], names: list[str], width: int
    ) -> tuple[Any, Problems]:
        n = len(columns[names[0]])
        matrix, problems = np.empty((n, width), np.float32), Problems()
        for j, name in enumerate(names):
            matrix[:, j], found = checks.numbers(columns[name], name)
            problems = found | problems  # each row's first problem wins
        return matrix, problems
