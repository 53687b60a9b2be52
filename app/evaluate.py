"""Evaluate: accuracy, per-class precision/recall/F1 and the confusion matrix on held-out rows.

Runs on the driver without Ray: shards stream one at a time through the checkpoint's own
preprocessor; the metrics are scikit-learn's. The held-out split is `test` when the dataset has one, else `val`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from app import storage
from app.config import Config
from app.data.ingest import iter_shards
from app.data.prepare import DatasetManifest, read_manifest, split_files, verify_shards
from app.data.preprocess import Preprocessor
from app.tasks.registry import Part, run_task
from app.train.checkpoint import META, CheckpointMeta, LoadedCheckpoint, load_checkpoint

log = logging.getLogger(__name__)
Predict = Callable[[dict[str, np.ndarray]], np.ndarray]  # model inputs -> logits
EVALUATION_FILE = "evaluation.json"


class Evaluate(Protocol):
    """A checkpoint scored on a held-out split: the evaluate summary."""

    def __call__(
        self, config: Config, checkpoint_uri: str, loaded: LoadedCheckpoint, split: str, /
    ) -> dict[str, Any]: ...


EVALUATE = Part[Evaluate]("evaluate")
CONFUSION_PNG, CURVES_PNG = "confusion_matrix.png", "training_curves.png"


def evaluate(config: Config, checkpoint_uri: str) -> dict[str, Any]:
    loaded = load_checkpoint(checkpoint_uri)
    manifest = read_manifest(config.data_output)
    split = "test" if "test" in manifest.splits else "val"
    verify_shards(config.data_output, manifest, split)
    task = run_task(loaded.config.train.task, loaded.preprocessor.kind)
    return task.part(EVALUATE)(config, checkpoint_uri, loaded, split)


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


def evaluate_language_model(
    config: Config, checkpoint_uri: str, loaded: LoadedCheckpoint, split: str
) -> dict[str, Any]:
    """Task `lm`: next-token loss and perplexity beside the unigram baseline's (app/tasks/lm.py)."""
    from app.tasks.lm import evaluate_lm

    metrics = evaluate_lm(config, loaded.model, loaded.preprocessor, split)
    storage.write_json(storage.join(checkpoint_uri, EVALUATION_FILE), metrics)
    log.info(
        "evaluate: perplexity %.2f (unigram baseline %.1f) on %d %s tokens",
        metrics["perplexity"],
        metrics["baseline_perplexity"],
        metrics["tokens"],
        split,
    )
    return {"stage": "evaluate", "checkpoint": checkpoint_uri, "metrics": metrics}


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


def run_history(checkpoint_uri: str, meta: CheckpointMeta) -> list[dict[str, Any]]:
    """Every epoch of the checkpoint's run. The evaluated checkpoint (usually the best, often
    not the last) records the epochs up to its own; the newest checkpoint in the same run folder
    records them all, including those after the best (where early stopping looked)."""
    run_dir = checkpoint_uri.rstrip("/").rsplit("/", 1)[0]
    history = list(meta.history)
    for name in storage.list_dir(run_dir):
        uri = storage.join(run_dir, name, META)
        if not name.startswith("checkpoint_") or not storage.exists(uri):
            continue
        try:
            other = CheckpointMeta.read(uri)
        except Exception:  # noqa: BLE001 - a sibling being written or damaged: use what we have
            continue
        if len(other.history) > len(history) and other.history[: len(history)] == history:
            history = list(other.history)
    return history


def labeled_batches(
    config: Config,
    pre: Preprocessor,
    split: str,
    manifest: DatasetManifest | None = None,
    batch_rows: int = 512,
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """(model inputs, label indices) for one split, shard by shard."""
    output = config.data_output
    manifest = manifest or read_manifest(output)
    for frame in iter_shards(split_files(output, manifest, split)):
        for start in range(0, len(frame), batch_rows):
            part = frame.iloc[start : start + batch_rows]
            batch = pre.transform_batch({c: part[c].to_numpy() for c in part.columns})
            labels = batch.pop("label")
            yield batch, labels


def verify_dataset(config: Config, splits: tuple[str, ...]) -> None:
    """Hash every shard of `splits` once against the dataset manifest (a one-line refusal)."""
    manifest = read_manifest(config.data_output)
    for split in splits:
        verify_shards(config.data_output, manifest, split)


def torch_predict(model: torch.nn.Module) -> Predict:
    model.eval()

    @torch.no_grad()
    def predict(inputs: dict[str, np.ndarray]) -> np.ndarray:
        return model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).float().numpy()

    return predict


def predictions(predict: Predict, batches) -> tuple[np.ndarray, np.ndarray]:
    y_true, y_pred = [], []
    for inputs, labels in batches:
        y_pred.append(predict(inputs).argmax(1))
        y_true.append(labels)
    return np.concatenate(y_true), np.concatenate(y_pred)


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
