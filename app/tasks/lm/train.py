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
from app.models.causal import IGNORE, TokenLoss, packed_inputs, takes_targets
from app.train.checkpoint import unwrap
from app.train.steps import all_reduce, autocast

if TYPE_CHECKING:  # driver-side types; workers import this module too
    from app.config import Config
    from app.data.prepare import DatasetManifest
    from app.data.preprocess import Preprocessor

log = logging.getLogger(__name__)
TOKENS_KEY = "input_ids"
TRAINED_KEY = "trained"  # chat rows: 1 where the token is a target the loss counts
SEGMENTS_KEY = "segments"  # packed rows: each token's sequence in its row (0: padding)


def model_inputs(
    batch: dict[str, torch.Tensor], device: torch.device, trim: bool = True
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A batch of rows -> the model's inputs (each row's first `block_size` ids; for packed
    rows each token's position in its own sequence and the mask that keeps the sequences apart)
    and its targets (the next ids; IGNORE where a chat row does not train them).

    Chat rows end in padding: `trim` cuts the batch after its longest row (causal attention
    never looks right, so the loss is the same), and rows of one sequence each need no mask."""
    if trim and SEGMENTS_KEY in batch:
        batch = trimmed(batch)
    ids = batch[TOKENS_KEY].to(device)
    targets = ids[:, 1:]
    if TRAINED_KEY in batch:
        trained = batch[TRAINED_KEY].to(device)[:, 1:].bool()
        targets = torch.where(trained, targets, torch.full_like(targets, IGNORE))
    inputs = {"input_ids": ids[:, :-1]}
    if SEGMENTS_KEY in batch and int(batch[SEGMENTS_KEY].max()) > 1:
        positions, mask = packed_inputs(batch[SEGMENTS_KEY].to(device)[:, :-1])
        inputs |= {"position_ids": positions, "attention_mask": mask}
    return inputs, targets


def trimmed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch without the padding columns every row ends in (at least two columns kept)."""
    used = (batch[SEGMENTS_KEY] > 0).any(0).nonzero()
    width = max(2, int(used[-1]) + 1 if len(used) else 0)
    return {k: v[:, :width] if v.dim() == 2 else v for k, v in batch.items()}


def scored(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> TokenLoss | None:
    """The batch's loss as sums: computed in the model's forward (in chunks, where a sharded
    run has its head) when it keeps the causal-LM contract, else from its logits; None on a
    pipeline rank that does not hold the last stage."""
    inputs, targets = model_inputs(batch, device)
    if takes_targets(unwrap(model)):
        return model(**inputs, targets=targets)
    logits = model(**inputs)
    return None if logits is None else logits_loss(logits, targets)


def next_token_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, int]:
    """Mean next-token cross entropy over a batch's trained targets, and its rows."""
    out = scored(model, batch, device)
    assert out is not None, "a pipeline trains through its schedule, not this loss"
    return out.mean, len(batch[TOKENS_KEY])


def shifted(
    batch: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A pipeline's batch: the model inputs (each row's first `block_size` ids) and targets
    (the next ids, IGNORE where untrained). Packed rows cannot cross stages (their masks are
    not part of a stage's state): the driver refuses that pairing."""
    inputs, targets = model_inputs(batch, torch.device("cpu"), trim=False)  # stages: one shape
    return {"input_ids": inputs["input_ids"]}, targets


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of [batch, time, vocab] logits against [batch, time] token ids, over
    the trained targets (0 when there are none)."""
    return logits_loss(logits, targets).mean


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> TokenLoss:
    flat, goal = logits.flatten(0, 1).float(), targets.flatten()
    trained = goal != IGNORE
    total = F.cross_entropy(flat, goal, ignore_index=IGNORE, reduction="sum")
    correct = ((flat.argmax(-1) == goal) & trained).sum()
    return TokenLoss(total, trained.sum(), correct)


@torch.no_grad()
def validate_lm(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    precision: str,
    reference: dict[str, float] | None = None,
) -> dict[str, float]:
    """Loss, perplexity and top-1 accuracy over every trained target of `batches`, summed over
    ranks; `reference` (the driver's baseline) is reported beside them."""
    model.eval()
    loss_sum, correct, tokens = 0.0, 0.0, 0.0
    for batch in batches:
        batch, padding = unpadded(batch)
        with autocast(device, precision):
            out = scored(model, batch, device)
        if padding or out is None:  # a pass to match the other ranks' collectives only
            continue
        loss_sum += out.total.item()
        correct += out.correct.item()
        tokens += out.tokens.item()
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


def token_rows(files: list[str], batch_rows: int = 256) -> Iterator[dict[str, np.ndarray]]:
    """Batches of rows, shard by shard, `batch_rows` at a time: [rows, block_size + 1] int64
    ids, and for chat rows their `trained` and `segments` columns."""
    import pyarrow.parquet as pq

    from app import storage

    for uri in files:
        fs, path = storage.filesystem(uri)
        table = pq.read_table(path, filesystem=fs)
        columns = {
            name: _fixed_rows(table.column(name), np.int64 if name == TOKENS_KEY else np.int32)
            for name in (TOKENS_KEY, TRAINED_KEY, SEGMENTS_KEY)
            if name in table.column_names
        }
        for start in range(0, table.num_rows, batch_rows):
            yield {name: rows[start : start + batch_rows] for name, rows in columns.items()}


def _fixed_rows(column: Any, dtype: Any) -> np.ndarray:
    flat = column.combine_chunks().flatten().to_numpy()
    return flat.reshape(len(column), -1).astype(dtype)


def trained_targets(batch: dict[str, np.ndarray]) -> np.ndarray:
    """The ids the loss counts: every row's ids after the first, of a chat row its trained ones."""
    targets = batch[TOKENS_KEY][:, 1:]
    if TRAINED_KEY in batch:
        return targets[batch[TRAINED_KEY][:, 1:].astype(bool)]
    return targets.ravel()


def target_counts(batches: Iterable[dict[str, np.ndarray]], vocab_size: int) -> np.ndarray:
    """How often each token id is a trained target."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in batches:
        counts += np.bincount(trained_targets(batch), minlength=vocab_size)[:vocab_size]
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
    files = split_files(config.data_output, manifest, split)
    batches = (
        {name: torch.from_numpy(rows) for name, rows in batch.items()}
        for batch in token_rows(files, batch_rows)
    )
    scored = validate_lm(model, batches, torch.device("cpu"), "fp32")
    vocab = tokens_of(preprocessor).vocab_size
    return {
        "split": split,
        "loss": scored["val_loss"],
        "perplexity": scored["val_perplexity"],
        "token_accuracy": scored["val_token_accuracy"],
        "baseline_perplexity": baseline_perplexity(config, manifest, vocab, split),
        "tokens": int(sum(len(trained_targets(b)) for b in token_rows(files))),
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
