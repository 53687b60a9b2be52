"""Evaluate: a checkpoint scored on held-out rows by its task's `EVALUATE` part (app/tasks/<task>/
evaluate.py), on the driver without Ray: shards stream one at a time through the checkpoint's
own preprocessor. The held-out split is `test` when the dataset has one, else `val`. Here too
what several stages score with: labelled batches, a torch model's predictions."""

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
from app.registry import Part, run_task
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


def evaluate(config: Config, checkpoint_uri: str) -> dict[str, Any]:
    loaded = load_checkpoint(checkpoint_uri)
    manifest = read_manifest(config.data_output)
    split = "test" if "test" in manifest.splits else "val"
    verify_shards(config.data_output, manifest, split)
    task = run_task(loaded.config.train.task, loaded.preprocessor.kind)
    return task.part(EVALUATE)(config, checkpoint_uri, loaded, split)


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
