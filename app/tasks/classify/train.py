"""Task `classify`: labelled rows (images, tabular features or text) -> one class per row.

Its loss is the mean cross entropy of a batch, its validation reports loss and accuracy summed
over ranks; evaluation, export and serving are the classifier paths named in the registry entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app.data.feed import unpadded
from app.data.preprocess import LABEL_KEY
from app.train.steps import all_reduce, autocast


def split_batch(
    batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    labels = batch[LABEL_KEY].to(device)
    inputs = {k: v.to(device) for k, v in batch.items() if k != LABEL_KEY}
    return inputs, labels


def labelled(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A batch's model inputs and its labels (a pipeline's first-stage inputs and target)."""
    return {k: v for k, v in batch.items() if k != LABEL_KEY}, batch[LABEL_KEY]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def classification_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, int]:
    """Mean cross entropy of a labelled batch, and its rows."""
    inputs, labels = split_batch(batch, device)
    return F.cross_entropy(model(**inputs), labels), len(labels)


@torch.no_grad()
def validate_classifier(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    precision: str,
    reference: dict[str, float] | None = None,
) -> dict[str, float]:
    model.eval()
    loss_sum, correct, rows = 0.0, 0.0, 0.0
    for batch in batches:
        batch, padding = unpadded(batch)
        inputs, labels = split_batch(batch, device)
        with autocast(device, precision):
            logits = model(**inputs)
        if padding:  # a forward pass to match the other ranks'; nothing to count
            continue
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
        rows += len(labels)
    loss_sum, correct, rows = all_reduce([loss_sum, correct, rows], device)
    return {"val_loss": loss_sum / max(rows, 1), "val_accuracy": correct / max(rows, 1)}


def headline(metrics: dict[str, Any]) -> str:
    return f"val_loss {metrics['val_loss']:.4f} val_accuracy {metrics['val_accuracy']:.4f}"
