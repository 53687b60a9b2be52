"""Language modelling (task `lm`): next-token loss, validation, the unigram baseline, evaluation.

Rows of a token dataset hold `block_size + 1` ids (app/data/text_files.py): the model reads the first
`block_size` and is scored on predicting each next one. Losses are mean cross entropy per target
token in nats; perplexity is its exponential.

`baseline_perplexity` is a unigram model's (token frequencies of the train split, add-one
smoothed) on the same held-out tokens: the bar that says whether the model learned anything
beyond which tokens are common.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from app.data.feed import unpadded
from app.data.kinds.tokens import tokens_of
from app.train.steps import all_reduce, autocast

if TYPE_CHECKING:  # driver-side types; workers import this module too
    from app.config import Config
    from app.data.prepare import DatasetManifest
    from app.data.preprocess import Preprocessor

log = logging.getLogger(__name__)
TOKENS_KEY = "input_ids"


def next_token_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, int]:
    """Mean next-token cross entropy of a batch of rows, and its rows."""
    ids = batch[TOKENS_KEY].to(device)
    return token_loss(model(input_ids=ids[:, :-1]), ids[:, 1:]), len(ids)


def shifted(
    batch: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A batch's model inputs (each row's first `block_size` ids) and targets (the next ids)."""
    ids = batch[TOKENS_KEY]
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of [batch, time, vocab] logits against [batch, time] token ids."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def validate_lm(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    precision: str,
    reference: dict[str, float] | None = None,
) -> dict[str, float]:
    """Loss, perplexity and top-1 accuracy over every target token of `batches`, summed over
    ranks; `reference` (the driver's baseline) is reported beside them."""
    model.eval()
    loss_sum, correct, tokens = 0.0, 0.0, 0.0
    for batch in batches:
        batch, padding = unpadded(batch)
        ids = batch[TOKENS_KEY].to(device)
        targets = ids[:, 1:]
        with autocast(device, precision):
            logits = model(input_ids=ids[:, :-1])
        if padding:  # a forward pass to match the other ranks'; nothing to count
            continue
        loss_sum += F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"
        ).item()
        correct += (logits.argmax(-1) == targets).sum().item()
        tokens += targets.numel()
    loss_sum, correct, tokens = all_reduce([loss_sum, correct, tokens], device)
    loss = loss_sum / max(tokens, 1)
    return {
        "val_loss": loss,
        "val_perplexity": math.exp(min(loss, 50.0)),  # capped: a diverged run stays a number
        "val_token_accuracy": correct / max(tokens, 1),
        **(reference or {}),
    }


def headline(metrics: dict[str, Any]) -> str:
    return (
        f"val_loss {metrics['val_loss']:.4f} val_perplexity {metrics['val_perplexity']:.2f}"
        f" (unigram {metrics['baseline_perplexity']:.1f})"
    )


def reference_metrics(
    config: Config, manifest: DatasetManifest, preprocessor: Preprocessor
) -> dict[str, float]:
    """Reported with every epoch: the unigram baseline's validation perplexity."""
    return {
        "baseline_perplexity": baseline_perplexity(
            config, manifest, tokens_of(preprocessor).vocab_size
        )
    }


# --- reading token rows (driver side, no Ray) ----------------------------------------------------


def token_rows(files: list[str], batch_rows: int = 256) -> Iterator[np.ndarray]:
    """[rows, block_size + 1] int64 arrays, shard by shard, `batch_rows` at a time."""
    import pyarrow.parquet as pq

    from app import storage

    for uri in files:
        fs, path = storage.filesystem(uri)
        column = pq.read_table(path, filesystem=fs, columns=[TOKENS_KEY]).column(TOKENS_KEY)
        flat = column.combine_chunks().flatten().to_numpy()
        rows = flat.reshape(len(column), -1).astype(np.int64)
        for start in range(0, len(rows), batch_rows):
            yield rows[start : start + batch_rows]


def target_counts(rows: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    """How often each token id is a target (every row's ids after the first)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in rows:
        counts += np.bincount(batch[:, 1:].ravel(), minlength=vocab_size)[:vocab_size]
    return counts


def unigram_perplexity(train_counts: np.ndarray, heldout_counts: np.ndarray) -> float:
    """Perplexity on the held-out targets of token frequencies fitted on train (add-one)."""
    probs = (train_counts + 1.0) / (train_counts.sum() + len(train_counts))
    total = heldout_counts.sum()
    if total == 0:
        return float("nan")
    return float(np.exp(-(heldout_counts * np.log(probs)).sum() / total))


def baseline_perplexity(
    config: Config, manifest: DatasetManifest, vocab_size: int, split: str = "val"
) -> float:
    """The unigram baseline on `split`: train-split target frequencies, add-one smoothed."""
    from app.data.prepare import split_files

    output = config.data_output
    train = target_counts(token_rows(split_files(output, manifest, "train")), vocab_size)
    heldout = target_counts(token_rows(split_files(output, manifest, split)), vocab_size)
    return unigram_perplexity(train, heldout)


# --- jobs.evaluate for a language model ---------------------------------------------------------


def evaluate_lm(
    config: Config, model: nn.Module, preprocessor: Preprocessor, split: str, batch_rows: int = 32
) -> dict[str, Any]:
    """Loss, perplexity and the unigram baseline of a model on the held-out split."""
    from app.data.prepare import read_manifest, split_files

    manifest = read_manifest(config.data_output)
    pre = tokens_of(preprocessor)
    vocab = pre.vocab_size
    batches = (
        {TOKENS_KEY: torch.from_numpy(rows)}
        for rows in token_rows(split_files(config.data_output, manifest, split), batch_rows)
    )
    scored = validate_lm(model, batches, torch.device("cpu"), "fp32")
    tokens = manifest.rows[split] * pre.block_size
    return {
        "split": split,
        "loss": scored["val_loss"],
        "perplexity": scored["val_perplexity"],
        "token_accuracy": scored["val_token_accuracy"],
        "baseline_perplexity": baseline_perplexity(config, manifest, vocab, split),
        "tokens": int(tokens),
    }


def dataset_preprocessor(config: Config, manifest: DatasetManifest) -> Preprocessor:
    """A token dataset's preprocessor: the tokenizer trained at prepare, adopted as it is."""
    from app.data.kinds.tokens import Tokens
    from app.data.prepare import read_dataset_file
    from app.data.text_files import TOKENIZER_FILE
    from app.models.families import base_for

    tokenizer = read_dataset_file(config.data_output, manifest, TOKENIZER_FILE).decode()
    base = base_for(config.model, Tokens)
    return Tokens.adopt(manifest.to_json_dict(), tokenizer, base)
