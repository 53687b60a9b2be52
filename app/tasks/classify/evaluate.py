"""Task `classify`: a checkpoint scored on held-out rows: accuracy, per-class precision, recall
and F1 and the confusion matrix (scikit-learn), with its plots."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from app import storage
from app.config import Config
from app.data.prepare import read_manifest
from app.evaluate.held_out import (
    EVALUATION_FILE,
    labeled_batches,
    predictions,
    run_history,
    torch_predict,
)
from app.train.checkpoint import CheckpointMeta, LoadedCheckpoint

log = logging.getLogger(__name__)


CONFUSION_PNG, CURVES_PNG = "confusion_matrix.png", "training_curves.png"


def evaluate_classifier(
    config: Config, checkpoint_uri: str, loaded: LoadedCheckpoint, split: str
) -> dict[str, Any]:
    """Task `classify`: accuracy, per-class scores and the confusion matrix, with its plots."""
    manifest = read_manifest(config.data_output)
    batches = labeled_batches(config, loaded.preprocessor, split, manifest)
    y_true, y_pred = predictions(torch_predict(loaded.model), batches)
    metrics = classification_metrics(y_true, y_pred, loaded.preprocessor.labels)
    metrics["split"] = split
    storage.write_json(storage.join(checkpoint_uri, EVALUATION_FILE), metrics)
    log.info("evaluate: accuracy %.4f on %d %s rows", metrics["accuracy"], metrics["rows"], split)
    pictures = write_plots(checkpoint_uri, loaded.meta, metrics)
    return {
        "stage": "evaluate",
        "checkpoint": checkpoint_uri,
        "metrics": metrics,
        "plots": pictures,
    }


def write_plots(
    checkpoint_uri: str, meta: CheckpointMeta, metrics: dict[str, Any]
) -> dict[str, str]:
    """The confusion matrix and the run's training curves, as PNGs beside evaluation.json."""
    from app import plots

    uris = {"confusion_matrix": storage.join(checkpoint_uri, CONFUSION_PNG)}
    title = f"{metrics['split']} split: accuracy {100 * metrics['accuracy']:.2f}% ({metrics['rows']} rows)"
    storage.write_bytes(
        uris["confusion_matrix"],
        plots.confusion_matrix(metrics["confusion_matrix"], metrics["labels"], title),
    )
    history = run_history(checkpoint_uri, meta)
    if history:  # checkpoints written before the history was recorded have none
        uris["training_curves"] = storage.join(checkpoint_uri, CURVES_PNG)
        run_name = checkpoint_uri.rstrip("/").rsplit("/", 2)[-2]
        title = f"run {run_name}; dashed line: the evaluated checkpoint (epoch {meta.epoch})"
        storage.write_bytes(
            uris["training_curves"], plots.training_curves(history, meta.epoch, title)
        )
    return uris


def classification_metrics(
    y_true: np.ndarray, y_pred: np.ndarray, labels: list[str]
) -> dict[str, Any]:
    from sklearn.metrics import accuracy_score, confusion_matrix, precision_recall_fscore_support

    classes = list(range(len(labels)))
    confusion = confusion_matrix(y_true, y_pred, labels=classes)
    precision, recall, f1, support = precision_recall_fscore_support(
        y_true, y_pred, labels=classes, zero_division=0
    )
    return {
        "accuracy": float(accuracy_score(y_true, y_pred)) if len(y_true) else 0.0,
        "rows": int(len(y_true)),
        "macro_f1": float(np.mean(f1)),
        "per_class": {
            name: {
                "precision": float(precision[i]),
                "recall": float(recall[i]),
                "f1": float(f1[i]),
                "support": int(support[i]),
            }
            for i, name in enumerate(labels)
        },
        "labels": labels,
        "confusion_matrix": confusion.tolist(),
    }
