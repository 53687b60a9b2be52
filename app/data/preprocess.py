"""The fitted preprocessor: the one transform that training and serving both apply.

One subclass per kind of data (app/data/kinds/: tabular, image, text, tokens, documents), chosen
from one table there by the dataset's `kind`. Each owns what differs between kinds: fitting,
model inputs from raw rows, the raw input a request sends, a sample row, the column encoding of
its shards, the checks of raw rows read from a file, and its input names. It is fitted on the
train split only, serialises to JSON (it travels inside checkpoints and artifacts), and
transforms plain numpy batches without Ray, so a replica calls the very code the training
workers ran.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias

import numpy as np
import pandas as pd
import pyarrow as pa

from app.errors import UserError

if TYPE_CHECKING:
    from app.pretrained import Pretrained

LABEL_KEY = "label"  # key of the label index in transformed batches
Problems: TypeAlias = dict[int, str]  # row -> what is wrong with it; only bad rows are listed
Column: TypeAlias = "pa.Array | pa.ChunkedArray | list[Any]"


class PretrainedLookup(Protocol):
    """The run's pretrained folders, opened and checked to take data of a kind: what the data
    layer needs of them (a tokenizer, an image processor, a length), handed down by the layer
    that composes models and data (app/models/families.py `Bases`)."""

    def base(self, takes: type[Preprocessor] | None = None, /) -> Pretrained | None:
        """`model.pretrained`, checked to train on `takes` when given."""
        ...

    def towers(
        self, takes: type[Preprocessor] | None = None, /
    ) -> tuple[Pretrained | None, Pretrained | None]:
        """A dual encoder's (text, image) tower folders."""
        ...


@dataclass(frozen=True)
class FitOptions:
    max_length: int = 32  # tokens per text row
    vocab_size: int = 2000  # of a tokenizer trained on the train split
    base: Pretrained | None = None  # a pretrained folder whose preprocessing is adopted
    # A dual encoder of two folders: the text folder's tokenizer, the image folder's processor.
    text_base: Pretrained | None = None
    image_base: Pretrained | None = None
    image_size: int = 64  # pictures of a source with no size of its own, from scratch


class Preprocessor:
    """Raw features -> model inputs, and labels -> indices."""

    kind: ClassVar[str]
    input_name: ClassVar[str] = "features"  # the raw input tensor (schema.json, the v2 API)
    labelled: ClassVar[bool] = True  # its rows carry a label to learn
    variable_length: ClassVar[bool] = False  # inputs have a sequence axis a batch may cut

    def __init__(self, state: dict[str, Any]):
        self.state = state
        self.feature_columns: list[str] = state["feature_columns"]
        self.label_column: str = state["label_column"]
        self.labels: list[str] = state["labels"]
        self._label_index = {name: i for i, name in enumerate(self.labels)}

    # --- fitting ---------------------------------------------------------------------------

    @classmethod
    def fit(
        cls, chunks: Iterable[pd.DataFrame], manifest: dict[str, Any], options: FitOptions
    ) -> Preprocessor:
        """Fit on the train split, streamed chunk by chunk (one shard at a time, never all rows).

        With a pretrained `options.base`, its tokenizer or image processor is adopted (none is
        trained and no statistics are taken) and its record travels in the state."""
        labels: set[str] = set()
        rows = 0

        def labelled(chunks: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
            nonlocal rows
            for chunk in chunks:
                rows += len(chunk)
                if cls.labelled:
                    labels.update(chunk[manifest["label_column"]].astype(str))
                yield chunk

        state: dict[str, Any] = {
            "version": 1,
            "kind": cls.kind,
            "feature_columns": manifest["feature_columns"],
            "label_column": manifest["label_column"],
        }
        if options.base is not None:
            state["pretrained"] = options.base.record()
        bases = {"text": options.text_base, "image": options.image_base}
        if any(bases.values()):  # a dual encoder's pretrained towers (one may be from scratch)
            state["towers"] = {name: b.record() for name, b in bases.items() if b is not None}
        state |= cls.fit_state(labelled(chunks), manifest, options)
        if not rows:
            raise UserError("the train split is empty: nothing to fit the preprocessor on")
        # Labels come from the train split alone; an unseen label later is an error.
        state["labels"] = sorted(labels)
        return cls(state)

    @classmethod
    def fit_state(
        cls, chunks: Iterator[pd.DataFrame], manifest: dict[str, Any], options: FitOptions
    ) -> dict[str, Any]:
        """This kind's fitted state, from every chunk of the train split (all consumed)."""
        raise UserError(f"{cls.kind} data is not fitted: its task prepares it")

    def to_json(self) -> str:
        return json.dumps(self.state, sort_keys=True)

    # --- what export, serving and the data path ask -----------------------------------------

    @property
    def num_features(self) -> int:
        """Raw values a row holds (1 for a text row)."""
        return 1

    def row_bytes(self) -> int:
        """Bytes of one transformed row (model inputs + label index): sizes the data cache."""
        return 4 * self.num_features + 8  # float32 features, int64 label index

    def input_names(self) -> list[str]:
        return ["x"]

    def raw_input(self) -> dict[str, Any]:
        """The one raw input tensor a request sends, as schema.json (and the v2 API) name it."""
        return {"name": self.input_name, "datatype": "FP32", "shape": [-1, self.num_features]}

    def sample_rows(self) -> Any:
        """One raw row of the right form (a replica's health check and warm-up)."""
        return np.zeros((1, self.num_features), np.float32)

    # --- transforms ------------------------------------------------------------------------

    def features(self, raw: Any) -> dict[str, np.ndarray]:
        """Model inputs for raw rows."""
        raise NotImplementedError

    def raw_features(self, batch: dict[str, np.ndarray] | pd.DataFrame) -> Any:
        """Raw feature rows out of a batch of prepared shards (columns as the manifest lists)."""
        column = np.asarray(batch[self.feature_columns[0]])
        # Ray Data hands list columns over as an object array of per-row arrays.
        return np.stack(list(column)) if column.dtype == object else column

    def label_indices(self, labels: Iterable[Any]) -> np.ndarray:
        out = []
        for row, label in enumerate(labels):
            index = self._label_index.get(str(label))
            if index is None:
                raise UserError(
                    f"row {row}: label {label!r} is not among the fitted labels {self.labels}"
                )
            out.append(index)
        return np.asarray(out, dtype=np.int64)

    def transform_batch(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A batch of shard rows -> model inputs + label indices (used in Ray Data map_batches)."""
        out = self.features(self.raw_features(batch))
        if self.label_column in batch:
            out[LABEL_KEY] = self.label_indices(batch[self.label_column])
        return out

    # --- raw data, before any fitting (prepare, the pipeline's sample, jobs.predict) ------------

    @classmethod
    def arrow_column(cls, name: str, values: pd.Series) -> pa.Array:
        """A source column as its shards store it (raw values, unchanged)."""
        return pa.array(values.to_numpy() if values.dtype != object else values.to_list())

    @classmethod
    def sample_tensor(cls, frame: pd.DataFrame, columns: list[str]) -> dict[str, Any]:
        """A v2 input tensor holding the raw rows of `frame` (the pipeline's sample request)."""
        values = [list(map(float, r)) for r in frame[columns[0]]]
        rows = len(values)
        return {
            "name": cls.input_name,
            "datatype": "FP32",
            "shape": [rows, len(values[0])],
            "data": values,
        }

    @classmethod
    def check_columns(
        cls, columns: dict[str, Column], names: list[str], width: int
    ) -> tuple[Any, Problems]:
        """Raw rows read from a file (Arrow columns, or JSON values per column) -> the rows as
        `features` takes them, and a problem per bad row (jobs.predict)."""
        raise UserError(f"{cls.kind} data cannot be scored row by row")

    @classmethod
    def good_rows(cls, raw: Any, good: np.ndarray, width: int) -> Any:
        """The rows of `raw` (as `check_columns` returned it) at the indices `good`."""
        return raw[good] if len(good) else np.zeros((0, width), np.float32)


class RunningStats:
    """Per-column mean and standard deviation over chunks, in float64."""

    def __init__(self) -> None:
        self.n, self.total, self.squares = 0, 0.0, 0.0

    def add(self, values: np.ndarray) -> None:
        values = values.astype(np.float64)
        self.n += values.shape[0]
        self.total = self.total + values.sum(axis=0)
        self.squares = self.squares + (values**2).sum(axis=0)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self.n == 0:
            raise UserError("the train split is empty: nothing to fit the preprocessor on")
        mean = np.atleast_1d(self.total / self.n)
        std = np.sqrt(np.maximum(np.atleast_1d(self.squares / self.n) - mean**2, 0.0))
        return mean, np.where(std > 1e-8, std, 1.0)
