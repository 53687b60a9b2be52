"""What a run learns, decided by its dataset: `classify` (labelled rows) or `lm` (token rows).

A task is the part of training that differs between the two: the loss of one batch, the
validation metrics, the metrics the driver computes once (the LM's unigram baseline), and the
epoch's log line. Everything else (feeds, DDP, checkpoints, reporting) is shared.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.config import Config
from app.errors import ConfigError
from app.tasks.lm import next_token_loss, validate_lm
from app.train.loop import LossFn, classification_loss, validate_epoch

if TYPE_CHECKING:
    from app.data.prepare import DatasetManifest
    from app.data.preprocess import Preprocessor

Validate = Callable[[nn.Module, Iterable[dict[str, torch.Tensor]], torch.device, str], dict]
# Reported by every task's training epoch (app/train/loop.py train_epoch) besides its own metrics.
TRAIN_METRICS = ("train_loss", "samples_per_second", "epoch_seconds", "learning_rate")


@dataclass(frozen=True)
class Task:
    name: str
    loss: LossFn
    validate: Validate
    metrics: tuple[str, ...]  # what `validate` reports

    def headline(self, metrics: dict[str, Any]) -> str:
        """The task's part of the epoch log line."""
        if self.name == "lm":
            return (
                f"val_loss {metrics['val_loss']:.4f} val_perplexity {metrics['val_perplexity']:.2f}"
                f" (unigram {metrics['baseline_perplexity']:.1f})"
            )
        return f"val_loss {metrics['val_loss']:.4f} val_accuracy {metrics['val_accuracy']:.4f}"


def task_for(kind: str, reference: dict[str, float] | None = None) -> Task:
    """The task of a dataset kind; `reference`: metrics the driver computed (reported as is)."""
    if kind == "tokens":
        return Task(
            "lm",
            next_token_loss,
            functools.partial(validate_lm, reference=reference),
            ("val_loss", "val_perplexity", "val_token_accuracy", "baseline_perplexity"),
        )
    return Task("classify", classification_loss, validate_epoch, ("val_loss", "val_accuracy"))


def check_metric(config: Config, task: Task) -> None:
    """The checkpoint ranking metric must be one the task reports (before any worker starts)."""
    known = (*task.metrics, *TRAIN_METRICS)
    t = config.train
    keys = {"train.checkpoint_metric": t.checkpoint_metric}
    if t.early_stopping_patience is not None:
        keys["train.early_stopping_metric"] = t.early_stopping_metric
    for key, metric in keys.items():
        if metric not in known:
            raise ConfigError(
                f"config error: {key}: {metric!r} is not reported by task "
                f"{task.name!r} (reports: {', '.join(known)})"
            )


def reference_metrics(
    config: Config, manifest: DatasetManifest, preprocessor: Preprocessor
) -> dict[str, float]:
    """Metrics computed once on the driver and reported with every epoch: for `lm` the unigram
    baseline's validation perplexity."""
    if manifest.kind != "tokens":
        return {}
    from app.tasks.lm import baseline_perplexity

    return {"baseline_perplexity": baseline_perplexity(config, manifest, preprocessor.vocab_size)}
