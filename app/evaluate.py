"""Evaluate: accuracy, per-class precision/recall/F1 and the confusion matrix on held-out rows.

Runs on the driver without Ray: shards stream one at a time through the checkpoint's own
preprocessor; the metrics are scikit-learn's. The held-out split is `test` when the dataset has one, else `val`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
RECALL_PNG = "recall_at_k.png"


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


def evaluate_retrieval(
    config: Config, checkpoint_uri: str, loaded: LoadedCheckpoint, split: str
) -> dict[str, Any]:
    """Task `retrieval`: Recall@1/5/10 both ways with every caption of a picture counted, their
    sum, chance, the binding subset's score where the data has one, and recall against K."""
    from app import plots
    from app.tasks.retrieval import chance, recall

    model = loaded.model.eval()
    split_rows = embed_split(config, loaded.preprocessor, split, torch_encoders(model))
    metrics: dict[str, Any] = recall(split_rows.images, split_rows.texts, split_rows.groups)
    pictures = len(np.unique(split_rows.groups))
    metrics |= {"chance_r1": chance(pictures, len(split_rows.texts)), "pictures": pictures}
    metrics |= {"captions": len(split_rows.texts), "split": split}
    if (binding := split_rows.binding()) is not None:
        metrics["binding_accuracy"] = binding
    storage.write_json(storage.join(checkpoint_uri, EVALUATION_FILE), metrics)
    curve = recall_at_k(split_rows, 10)
    png = storage.join(checkpoint_uri, RECALL_PNG)
    storage.write_bytes(png, plots.recall_curve(curve, f"{split} split: recall against K"))
    log.info(
        "evaluate: i2t R@1 %.1f t2i R@1 %.1f rsum %.1f (chance R@1 %.2f) on %d %s pictures",
        metrics["i2t_r1"],
        metrics["t2i_r1"],
        metrics["rsum"],
        metrics["chance_r1"],
        pictures,
        split,
    )
    return {
        "stage": "evaluate",
        "checkpoint": checkpoint_uri,
        "metrics": metrics,
        "plots": {"recall": png},
    }


Encoders = tuple[
    Callable[[dict[str, np.ndarray]], np.ndarray], Callable[[dict[str, np.ndarray]], np.ndarray]
]


@dataclass
class SplitEmbeddings:
    """A split's rows embedded: a picture's embedding on each of its captions' rows."""

    images: np.ndarray
    texts: np.ndarray
    groups: np.ndarray
    twins: np.ndarray  # the twin picture's group number, -1 for none

    def binding(self) -> float | None:
        """Of the captions of pictures with a twin (the same objects, two colours swapped):
        the share closer to their own picture than to its twin (%)."""
        has = self.twins >= 0
        if not has.any():
            return None
        first = {g: i for i, g in reversed(list(enumerate(self.groups)))}
        twin_rows = np.asarray([first.get(t, -1) for t in self.twins[has]])
        known = twin_rows >= 0
        texts, own = self.texts[has][known], self.images[has][known]
        other = self.images[twin_rows[known]]
        return 100.0 * float(np.mean((texts * own).sum(1) > (texts * other).sum(1)))


def embed_split(
    config: Config,
    pre: Preprocessor,
    split: str,
    encoders: Encoders,
    max_rows: int | None = None,
    batch_rows: int = 256,
) -> SplitEmbeddings:
    """Every row of a split (the first `max_rows`) through `encoders` (image inputs -> image
    embeddings, text inputs -> text embeddings), shard by shard on the driver."""
    from app.data.kinds.image_text import GROUP_KEY, group_number

    encode_image, encode_text = encoders
    output = config.data_output
    parts: dict[str, list[np.ndarray]] = {"images": [], "texts": [], "groups": [], "twins": []}
    taken = 0
    for frame in iter_shards(split_files(output, read_manifest(output), split)):
        for start in range(0, len(frame), batch_rows):
            part = frame.iloc[start : start + batch_rows]
            if max_rows is not None:
                part = part.iloc[: max_rows - taken]
            batch = pre.transform_batch({c: part[c].to_numpy() for c in part.columns})
            parts["images"].append(encode_image({"pixels": batch["pixels"]}))
            texts = {k: batch[k] for k in ("input_ids", "attention_mask")}
            parts["texts"].append(encode_text(texts))
            parts["groups"].append(batch[GROUP_KEY])
            twins = part["twin"] if "twin" in part else [""] * len(part)
            parts["twins"].append(np.asarray([group_number(t) if t else -1 for t in twins]))
            taken += len(part)
            if max_rows is not None and taken >= max_rows:
                break
        if max_rows is not None and taken >= max_rows:
            break
    return SplitEmbeddings(**{k: np.concatenate(v) for k, v in parts.items()})


def torch_encoders(model: Any) -> Encoders:
    @torch.no_grad()
    def image(inputs: dict[str, np.ndarray]) -> np.ndarray:
        return model.encode_image(torch.from_numpy(inputs["pixels"])).float().numpy()

    @torch.no_grad()
    def text(inputs: dict[str, np.ndarray]) -> np.ndarray:
        tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
        return model.encode_text(**tensors).float().numpy()

    return image, text


def recall_at_k(rows: SplitEmbeddings, top: int) -> dict[str, list[float]]:
    from app.tasks.retrieval import recall

    metrics = recall(rows.images, rows.texts, rows.groups, tuple(range(1, top + 1)))
    return {
        "image -> text": [metrics[f"i2t_r{k}"] for k in range(1, top + 1)],
        "text -> image": [metrics[f"t2i_r{k}"] for k in range(1, top + 1)],
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
