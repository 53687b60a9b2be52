"""Token rows: a corpus tokenized and packed at prepare (app/data/text_files.py), `block_size + 1`
ids a row (inputs and targets in one: the loss shifts them); chat rows (app/data/chat_source.py)
also carry which tokens are trained and which conversation each belongs to. Not fitted: the
preprocessor only carries the dataset's tokenizer, its chat template and end ids (for
generation) and its sequence length."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa

from app.data.preprocess import Preprocessor

if TYPE_CHECKING:
    from app.pretrained import Pretrained

# A tokenizer trained at prepare (app/data/text_files.py) has one special token, which ends
# every document.
EOS = "<|endoftext|>"


class Tokens(Preprocessor):
    kind = "tokens"
    labelled = False

    def __init__(self, state: dict[str, Any]):
        super().__init__(state)
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(state["tokenizer"])  # packed: no padding

    @classmethod
    def adopt(
        cls, manifest: dict[str, Any], tokenizer: str, base: Pretrained | None = None
    ) -> Tokens:
        state = {
            "version": 1,
            "kind": cls.kind,
            "feature_columns": manifest["feature_columns"],
            "label_column": manifest["label_column"],
            "labels": [],
            "tokenizer": tokenizer,
            "block_size": manifest["block_size"],
        }
        state["end_ids"] = base.end_ids() if base else trained_end_ids(state["tokenizer"])
        if base is not None:
            state["pretrained"] = base.record()
            # Serving renders chat messages with them (app/tasks/lm/chat.py).
            state["chat_special_tokens"] = base.special_tokens()
            if (template := base.chat_template()) is not None:
                state["chat_template"] = template
                # A chat model ends its answer with the template's end of turn, which may not
                # be the folder's eos (Qwen2.5's base models: <|endoftext|> vs <|im_end|>).
                turn_end = template_turn_end(template, state)
                state["end_ids"] += [turn_end] if turn_end is not None else []
                state["end_ids"] = list(dict.fromkeys(state["end_ids"]))
        return cls(state)

    @property
    def end_ids(self) -> list[int]:
        """The ids that end a generation (the folder's own, or the trained tokenizer's end of
        text)."""
        return [
            int(i) for i in self.state.get("end_ids") or trained_end_ids(self.state["tokenizer"])
        ]

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    @property
    def block_size(self) -> int:
        """Tokens a model reads per sequence (its rows hold one more: the last one's target)."""
        return int(self.state["block_size"])

    def row_bytes(self) -> int:
        # int64 ids; a chat row's trained flags (1 byte) and segments (4 bytes) beside them
        per_token = {"input_ids": 8, "trained": 1, "segments": 4}
        return sum(per_token.get(c, 8) for c in self.feature_columns) * (self.block_size + 1)

    def input_names(self) -> list[str]:
        return ["input_ids"]

    def features(self, raw: Any) -> dict[str, np.ndarray]:
        return {"input_ids": np.asarray(raw, dtype=np.int64)}

    def transform_batch(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rows of shards -> the ids as int64, and a chat row's trained flags and segments."""
        out = self.features(self.raw_features(batch))
        for column in self.feature_columns[1:]:
            values = np.asarray(batch[column])
            out[column] = np.stack(list(values)) if values.dtype == object else values
        return out

    @classmethod
    def arrow_column(cls, name: str, values: pd.Series) -> pa.Array:
        flat = np.stack(values.to_list()).astype(np.int32)
        return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])


def template_turn_end(template: str, state: dict[str, Any]) -> int | None:
    """The template's end of turn (None where a one-question conversation finds none)."""
    from tokenizers import Tokenizer

    from app.chat_template import TemplateRefused
    from app.data.chat_render import turn_end_token

    tokenizer = Tokenizer.from_str(state["tokenizer"])
    try:
        return turn_end_token(template, state["chat_special_tokens"], tokenizer)
    except TemplateRefused:
        return None


def trained_end_ids(tokenizer_json: str) -> list[int]:
    """A tokenizer trained at prepare (app/data/text_files.py) ends text with its only special
    token."""
    from tokenizers import Tokenizer

    token = Tokenizer.from_str(tokenizer_json).token_to_id(EOS)
    return [] if token is None else [token]


def tokens_of(pre: Preprocessor) -> Tokens:
    """A language model's preprocessor, narrowed to its kind (its task only ever gets one)."""
    if not isinstance(pre, Tokens):
        raise TypeError(f"expected a token dataset's preprocessor, got {pre.kind}")
    return pre
