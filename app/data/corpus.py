"""A text corpus -> a token dataset for language modelling (the `prepare` stage of task `lm`).

Documents (app/data/sources.py `text_files`) are split by document, so no file straddles train and
val. A byte-level BPE tokenizer is trained on the train documents only, every split is encoded
(each document followed by an end-of-text token) and packed into rows of `model.max_length + 1`
tokens: a row holds a sequence and, shifted by one, its next-token targets. Consecutive rows
overlap by one token, so every token but the split's first is a target exactly once; the tail
shorter than a row is dropped.

The tokenizer travels with the dataset (`tokenizer.json`, hashed in the manifest like a shard),
then inside the run's preprocessor, its checkpoints and artifacts: byte-level BPE can encode any
text, so generation never meets an unknown character.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from app.config import Config, ModelConfig
from app.data.kinds.tokens import Tokens
from app.data.sources import TEXT_COLUMN, SourceData
from app.errors import UserError
from app.models.families import base_for

if TYPE_CHECKING:
    from app.data.prepare import DatasetManifest
    from app.data.preprocess import Preprocessor

log = logging.getLogger(__name__)
EOS = "<|endoftext|>"  # separates documents; the only special token
TOKENIZER_FILE = "tokenizer.json"
TOKENS_COLUMN = "input_ids"


def tokenize_corpus(
    data: SourceData, splits: dict[str, np.ndarray], model: ModelConfig
) -> tuple[SourceData, dict[str, np.ndarray], dict[str, bytes]]:
    """(token rows, each split's rows, {file name: bytes} to store beside the shards)."""
    texts = data.frame[TEXT_COLUMN]
    base = base_for(model, Tokens)
    if base is None:
        tokenizer = train_tokenizer(texts.iloc[splits["train"]], model.vocab_size)
    else:  # the pretrained model's own tokenizer: none is trained
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(base.tokenizer_json())
    block = model.sequence_length(base.max_positions if base else None)
    parts, rows, start = [], {}, 0
    for name, index in splits.items():
        ids = encode_documents(tokenizer, texts.iloc[index].tolist())
        packed = pack(ids, block)
        if not len(packed):
            raise UserError(
                f"the {name} split holds {len(ids)} tokens, fewer than one sequence of "
                f"{block + 1}: add documents, raise data.val_fraction or lower "
                "model.max_length"
            )
        log.info("prepare: %s: %d tokens -> %d sequences", name, len(ids), len(packed))
        parts.append(packed)
        rows[name] = np.arange(start, start + len(packed))
        start += len(packed)
    frame = pd.DataFrame({TOKENS_COLUMN: list(np.concatenate(parts))})
    description = {
        **data.description,
        "tokenizer": f"{base.uri} (pretrained)" if base else "byte-level BPE",
        "vocab_size": tokenizer.get_vocab_size(),
        "documents_per_split": {name: int(len(index)) for name, index in splits.items()},
    }
    tokens = SourceData(
        frame, "tokens", [TOKENS_COLUMN], "", description=description, block_size=block
    )
    return tokens, rows, {TOKENIZER_FILE: tokenizer.to_str().encode()}


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2's scheme): every byte is in the base alphabet, so any text encodes
    and decodes back to itself exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_documents(tokenizer, texts: list[str]) -> np.ndarray:
    """All documents' token ids in order, each followed by the end-of-text token."""
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise UserError(f"the tokenizer has no {EOS} token to separate documents with")
    encoded = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    pieces = [np.asarray([*e.ids, eos], dtype=np.int32) for e in encoded]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def pack(ids: np.ndarray, block_size: int) -> np.ndarray:
    """[rows, block_size + 1] windows starting every `block_size` tokens (overlapping by one)."""
    rows = (len(ids) - 1) // block_size
    if rows <= 0:
        return np.zeros((0, block_size + 1), dtype=ids.dtype)
    windows = np.lib.stride_tricks.sliding_window_view(ids, block_size + 1)
    return np.ascontiguousarray(windows[: rows * block_size : block_size])


def dataset_preprocessor(config: Config, manifest: DatasetManifest) -> Preprocessor:
    """A token dataset's preprocessor: the tokenizer trained at prepare, adopted as it is."""
    from app.data.prepare import read_dataset_file

    tokenizer = read_dataset_file(config.data_output, manifest, TOKENIZER_FILE).decode()
    base = base_for(config.model, Tokens)
    return Tokens.adopt(manifest.to_json_dict(), tokenizer, base)
