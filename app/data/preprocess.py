"""The fitted preprocessor: the one transform that training and serving both apply.

It is fitted on the train split only, serialises to JSON (it travels inside checkpoints and
artifacts), and transforms plain numpy batches without Ray, so a replica calls the very code the
training workers ran.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from app.errors import UserError

if TYPE_CHECKING:
    from app.pretrained import Pretrained

LABEL_KEY = "label"  # key of the label index in transformed batches
PAD, UNK = "[PAD]", "[UNK]"


class Preprocessor:
    """Raw features -> model inputs (`x`, or `input_ids` + `attention_mask`) and labels -> indices."""

    def __init__(self, state: dict[str, Any]):
        self.state = state
        self.kind: str = state["kind"]
        self.feature_columns: list[str] = state["feature_columns"]
        self.label_column: str = state["label_column"]
        self.labels: list[str] = state["labels"]
        self._label_index = {name: i for i, name in enumerate(self.labels)}
        self._tokenizer = None
        if self.kind in ("text", "tokens"):
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_str(state["tokenizer"])
            if self.kind == "text":  # a token dataset is packed already: no truncation, no padding
                pad = state.get("pad_token", PAD)
                tokenizer.enable_truncation(state["max_length"])
                tokenizer.enable_padding(
                    length=state["max_length"],
                    pad_id=tokenizer.token_to_id(pad) or 0,
                    pad_token=pad,
                )
            self._tokenizer = tokenizer
            self._max_chars = text_char_bound(tokenizer, state.get("max_length"))
        self._images = None
        if "image_processor" in state:  # a pretrained image model's own resize and normalize
            from app.data.images import ImageProcessor

            self._images = ImageProcessor(state["image_processor"])
        self._mean = np.asarray(state.get("mean", 0.0), dtype=np.float32)
        self._std = np.asarray(state.get("std", 1.0), dtype=np.float32)

    # --- fitting ---------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        chunks: Iterable[pd.DataFrame],
        manifest: dict[str, Any],
        max_length: int = 32,
        vocab_size: int = 2000,
        base: Pretrained | None = None,
    ) -> Preprocessor:
        """Fit on the train split, streamed chunk by chunk (one shard at a time, never all rows).

        With a pretrained `base`, its tokenizer or image processor is adopted (none is trained
        and no pixel statistics are taken) and its record travels in the state."""
        kind = manifest["kind"]
        features, label_column = manifest["feature_columns"], manifest["label_column"]
        stats = _RunningStats()
        labels: set[str] = set()

        def texts() -> Iterable[str]:
            for chunk in chunks:
                labels.update(chunk[label_column].astype(str))
                if kind == "text":
                    yield from (str(t) for t in chunk[features[0]])
                elif kind == "image":
                    stats.add(np.stack(chunk[features[0]].to_list()).reshape(-1, 1))
                else:
                    stats.add(chunk[features].to_numpy(dtype=np.float64))

        state: dict[str, Any] = {
            "version": 1,
            "kind": kind,
            "feature_columns": features,
            "label_column": label_column,
        }
        if base is not None:
            state["pretrained"] = base.record()
        if kind == "text" and base is not None:
            state["max_length"] = max_length
            state["tokenizer"], state["pad_token"] = base.tokenizer_json(), base.pad_token()
            for _ in texts():
                pass
        elif kind == "text":
            state["max_length"] = max_length
            state["tokenizer"] = _train_tokenizer(texts(), vocab_size)
        elif kind == "image" and base is not None:
            state["image_shape"] = manifest["image_shape"]
            state["image_processor"] = base.image_processor()
            for _ in texts():
                pass
        else:
            for _ in texts():
                pass
            mean, std = stats.result()
            if kind == "image":
                state["image_shape"] = manifest["image_shape"]
                state["mean"], state["std"] = float(mean[0]), float(std[0])
            else:
                state["mean"], state["std"] = mean.tolist(), std.tolist()
        if not labels:
            raise UserError("the train split is empty: nothing to fit the preprocessor on")
        # Labels come from the train split alone; an unseen label later is an error.
        state["labels"] = sorted(labels)
        return cls(state)

    @classmethod
    def for_tokens(
        cls, manifest: dict[str, Any], tokenizer: str, base: Pretrained | None = None
    ) -> Preprocessor:
        """A token dataset (app/data/corpus.py) is already tokenized and packed: its preprocessor only
        carries the dataset's tokenizer (for generation) and its sequence length."""
        state = {
            "version": 1,
            "kind": "tokens",
            "feature_columns": manifest["feature_columns"],
            "label_column": manifest["label_column"],
            "labels": [],
            "tokenizer": tokenizer,
            "block_size": manifest["block_size"],
        }
        if base is not None:
            state["pretrained"] = base.record()
            # Serving renders chat messages with it (app/serve/chat.py).
            if (template := base.chat_template()) is not None:
                state["chat_template"] = template
                state["chat_special_tokens"] = base.special_tokens()
        return cls(state)

    # --- (de)serialisation -----------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(self.state, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Preprocessor:
        return cls(json.loads(text))

    # --- shapes that export and serving need -----------------------------------------------

    @property
    def num_features(self) -> int:
        if self.kind == "image":
            return int(np.prod(self.state["image_shape"]))
        return len(self.feature_columns) if self.kind == "tabular" else 1

    @property
    def vocab_size(self) -> int:
        assert self._tokenizer is not None
        return int(self._tokenizer.get_vocab_size())

    @property
    def block_size(self) -> int:
        """Tokens a model reads per sequence of a token dataset (its rows hold one more: the
        last token's target)."""
        return int(self.state["block_size"])

    @property
    def tokenizer(self) -> Any:
        assert self._tokenizer is not None
        return self._tokenizer

    def row_bytes(self) -> int:
        """Bytes of one transformed row (model inputs + label index): sizes the data cache."""
        if self.kind == "tokens":
            return 8 * (self.block_size + 1)  # int64 ids, no label
        label = 8  # int64 label index
        if self.kind == "text":
            return 2 * 8 * int(self.state["max_length"]) + label  # int64 ids + mask
        if self._images is not None:
            return 4 * int(np.prod(self._images.output_shape)) + label
        return 4 * self.num_features + label  # float32 features

    def input_names(self) -> list[str]:
        if self.kind == "tokens":
            return ["input_ids"]
        return ["input_ids", "attention_mask"] if self.kind == "text" else ["x"]

    @property
    def variable_length(self) -> bool:
        """Whether the model inputs have a sequence axis a batch may cut to its longest row."""
        return self.kind == "text"

    def raw_input(self) -> dict[str, Any]:
        """The one raw input tensor a request sends, as schema.json (and the v2 API) name it."""
        if self.kind == "text":
            return {"name": "text", "datatype": "BYTES", "shape": [-1]}
        name = "image" if self.kind == "image" else "features"
        return {"name": name, "datatype": "FP32", "shape": [-1, self.num_features]}

    def sample_rows(self) -> Any:
        """One raw row of the right form (a replica's health check and warm-up)."""
        if self.kind == "text":
            return ["health check"]
        return np.zeros((1, self.num_features), np.float32)

    # --- transforms ------------------------------------------------------------------------

    def features(self, raw: np.ndarray | Iterable[str]) -> dict[str, np.ndarray]:
        """Model inputs for raw rows: [n, features] numbers, or n strings for text, or [n, tokens]
        ids of a token dataset (inputs and targets in one: the loss shifts them)."""
        if self.kind == "tokens":
            return {"input_ids": np.asarray(raw, dtype=np.int64)}
        if self.kind == "text":
            assert self._tokenizer is not None
            texts = [str(t)[: self._max_chars] for t in raw]
            encoded = self._tokenizer.encode_batch(texts)
            ids = np.asarray([e.ids for e in encoded], dtype=np.int64).reshape(len(texts), -1)
            mask = np.asarray([e.attention_mask for e in encoded], dtype=np.int64).reshape(
                len(texts), -1
            )
            return {"input_ids": ids, "attention_mask": mask}
        if self._images is not None:
            pixels = np.asarray(raw, dtype=np.float32).reshape(-1, *self.state["image_shape"])
            return {"x": self._images(pixels)}
        x = (
            np.asarray(raw, dtype=np.float32).reshape(-1, self.num_features) - self._mean
        ) / self._std
        if self.kind == "image":
            x = x.reshape(-1, *self.state["image_shape"])
        return {"x": x.astype(np.float32)}

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

    def raw_features(self, batch: dict[str, np.ndarray] | pd.DataFrame) -> Any:
        """Raw feature rows out of a batch of prepared shards (columns as the manifest lists)."""
        if self.kind == "tabular":
            return np.stack(
                [np.asarray(batch[c], dtype=np.float32) for c in self.feature_columns], axis=1
            )
        column = batch[self.feature_columns[0]]
        if self.kind == "text":
            return list(column)
        column = np.asarray(column)
        # Ray Data hands list columns over as an object array of per-row arrays.
        return np.stack(list(column)) if column.dtype == object else column

    def transform_batch(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A batch of shard rows -> model inputs + label indices (used in Ray Data map_batches)."""
        out = self.features(self.raw_features(batch))
        if self.label_column in batch:
            out[LABEL_KEY] = self.label_indices(batch[self.label_column])
        return out


def text_char_bound(tokenizer: Any, max_length: int | None) -> int | None:
    """Characters of a text kept before tokenizing: twice what `max_length` tokens of the
    vocabulary's longest token (plus a space) can span. Tokenizing normalizes and splits the
    whole string before truncating, so a 4 MiB text would cost seconds; cut first, in training
    and serving alike, it costs nothing and ordinary text is never cut short of its tokens."""
    if not max_length:
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return 2 * max_length * (longest + 1)


class _RunningStats:
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


def _train_tokenizer(texts: Iterable[str], vocab_size: int) -> str:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token=UNK))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, UNK], show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer.to_str()
