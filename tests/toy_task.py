"""A task defined outside app/: classification with label smoothing that also reports how sure
the model is (`val_margin`). It proves a new task is one registry entry: train, export and serve
take it by `train.task=tests.toy_task:SMOOTHED` with no change to app/."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from app.registry import Task
from app.tasks.classify import task as classify
from app.tasks.classify.train import split_batch, validate_classifier
from app.train.parts import HEADLINE, LOSS, VALIDATE
from app.train.steps import all_reduce


def smoothed_loss(model, batch, device) -> tuple[torch.Tensor, int]:
    inputs, labels = split_batch(batch, device)
    return F.cross_entropy(model(**inputs), labels, label_smoothing=0.1), len(labels)


@torch.no_grad()
def validate_with_margin(model, batches, device, precision, reference=None) -> dict[str, float]:
    """The classifier's metrics plus the mean gap between the top two class probabilities."""
    batches = list(batches)
    metrics = validate_classifier(model, batches, device, precision)
    margin, rows = 0.0, 0
    for batch in batches:
        inputs, _ = split_batch(batch, device)
        top2 = model(**inputs).softmax(-1).topk(2, dim=-1).values
        margin += (top2[:, 0] - top2[:, 1]).sum().item()
        rows += len(top2)
    margin, rows = all_reduce([margin, float(rows)], device)
    return {**metrics, "val_margin": margin / max(rows, 1)}


def headline(metrics: dict[str, Any]) -> str:
    return f"val_accuracy {metrics['val_accuracy']:.4f} val_margin {metrics['val_margin']:.3f}"


# The classifier's evaluation, export, replica and smoke request; its own loss, validation and
# log line.
SMOOTHED = Task(
    name="smoothed",
    dataset_kinds=("tabular",),
    metrics=("val_loss", "val_accuracy", "val_margin"),
    parts={
        **classify.spec().parts,
        **dict([LOSS.of(smoothed_loss), VALIDATE.of(validate_with_margin), HEADLINE.of(headline)]),
    },
)
