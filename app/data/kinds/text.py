"""Text rows: one string column, tokenized to `max_length` ids (padded, with an attention mask)
by a WordPiece tokenizer trained on the train split, or a pretrained model's own tokenizer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pandas as pd

from app.data import checks
from app.data.preprocess import Column, FitOptions, Preprocessor, Problems

PAD, UNK = "[PAD]", "[UNK]"


class Text(Preprocessor):
    kind = "text"
    input_name = "text"
    variable_length = True

    def __init__(self, state: dict[str, Any]):
        super().__init__(state)
        self.tokenizer, self._max_chars = fixed_length_tokenizer(state)

    @classmethod
    def fit_state(
        cls, chunks: Iterator[pd.DataFrame], manifest: dict[str, Any], options: FitOptions
    ) -> dict[str, Any]:
        column = manifest["feature_columns"][0]
        texts = (str(t) for chunk in chunks for t in chunk[column])
        state: dict[str, Any] = {"max_length": options.max_length}
        if options.base is not None:
            for _ in texts:
                pass
            return state | {
                "tokenizer": options.base.tokenizer_json(),
                "pad_token": options.base.pad_token(),
            }
        return state | {"tokenizer": train_tokenizer(texts, options.vocab_size)}

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def row_bytes(self) -> int:
        return 2 * 8 * int(self.state["max_length"]) + 8  # int64 ids + mask, the label index

    def input_names(self) -> list[str]:
        return ["input_ids", "attention_mask"]

    def raw_input(self) -> dict[str, Any]:
        return {"name": self.input_name, "datatype": "BYTES", "shape": [-1]}

    def sample_rows(self) -> Any:
        return ["health check"]

    def features(self, raw: Iterable[str]) -> dict[str, np.ndarray]:
        texts = [str(t)[: self._max_chars] for t in raw]
        encoded = self.tokenizer.encode_batch(texts)
        ids = np.asarray([e.ids for e in encoded], dtype=np.int64).reshape(len(texts), -1)
        mask = np.asarray([e.attention_mask for e in encoded], dtype=np.int64)
        return {"input_ids": ids, "attention_mask": mask.reshape(len(texts), -1)}

    def raw_features(self, batch: dict[str, np.ndarray] | pd.DataFrame) -> Any:
        return list(batch[self.feature_columns[0]])

    @classmethod
    def sample_tensor(cls, frame: pd.DataFrame, columns: list[str]) -> dict[str, Any]:
        texts = frame[columns[0]].tolist()
        return {"name": cls.input_name, "datatype": "BYTES", "shape": [len(texts)], "data": texts}

    @classmethod
    def check_columns(
        cls, columns: dict[str, Column], names: list[str], width: int
    ) -> tuple[Any, Problems]:
        return checks.texts(columns[names[0]], names[0])

    @classmethod
    def good_rows(cls, raw: Any, good: np.ndarray, width: int) -> Any:
        return [raw[i] for i in good]


def text_char_bound(tokenizer: Any, max_length: int | None) -> int | None:
    """Characters of a text kept before tokenizing: twice what `max_length` tokens of the
    vocabulary's longest token (plus a space) can span. Tokenizing normalizes and splits the
    whole string before truncating, so a 4 MiB text would cost seconds; cut first, in training
    and serving alike, it costs nothing and ordinary text is never cut short of its tokens."""
    if not max_length:
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return 2 * max_length * (longest + 1)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> str:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token=UNK))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, UNK], show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer.to_str()


def fixed_length_tokenizer(state: dict[str, Any]) -> tuple[Any, int | None]:
    """The fitted state's tokenizer, truncating and padding to `max_length`, and the longest
    text (in characters) worth tokenizing for that many tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(state["tokenizer"])
    pad = state.get("pad_token", PAD)
    tokenizer.enable_truncation(state["max_length"])
    tokenizer.enable_padding(
        length=state["max_length"], pad_id=tokenizer.token_to_id(pad) or 0, pad_token=pad
    )
    return tokenizer, text_char_bound(tokenizer, state["max_length"])
