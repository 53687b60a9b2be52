"""The parts of a task that training calls (app/registry.py), each typed by its Protocol:
the loss of a batch, the validation of a model, the epoch's log line, metrics the driver
computes once for the run, and the batch split and loss a pipeline's stages need. A task's functions are checked against these where it is composed
(app/tasks/<task>/task.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from app.registry import Part

if TYPE_CHECKING:
    from app.config import Config
    from app.data.prepare import DatasetManifest
    from app.data.preprocess import Preprocessor


class Loss(Protocol):
    """The mean loss of a batch, and its rows."""

    def __call__(
        self, model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, /
    ) -> tuple[torch.Tensor, int]: ...


class Validate(Protocol):
    """Validation metrics of `model` over `batches`, summed over ranks (every rank calls it);
    `reference` is what the driver computed once (`Reference`)."""

    def __call__(
        self,
        model: nn.Module,
        batches: Iterable[dict[str, torch.Tensor]],
        device: torch.device,
        precision: str,
        /,
        reference: dict[str, float] | None = None,
    ) -> dict[str, float]: ...


class PipelineBatch(Protocol):
    """Under `train.strategy: pipeline`: a batch's inputs to the first stage (by the model's
    argument names) and the target the last stage's output is scored against."""

    def __call__(
        self, batch: dict[str, torch.Tensor], /
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]: ...


class OutputLoss(Protocol):
    """The mean loss of a model's output against its target (a pipeline's last stage)."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor, /) -> torch.Tensor: ...


class Headline(Protocol):
    """The task's part of an epoch's log line."""

    def __call__(self, metrics: dict[str, Any], /) -> str: ...


class Reference(Protocol):
    """Metrics the driver computes once per run, reported with every epoch (a baseline)."""

    def __call__(
        self, config: Config, manifest: DatasetManifest, preprocessor: Preprocessor, /
    ) -> dict[str, float]: ...


class DatasetPreprocessor(Protocol):
    """A dataset that carries its own preprocessing (a corpus tokenized at prepare): its
    preprocessor, adopted instead of fitted."""

    def __call__(self, config: Config, manifest: DatasetManifest, /) -> Preprocessor: ...


LOSS = Part[Loss]("loss")
VALIDATE = Part[Validate]("validate")
HEADLINE = Part[Headline]("headline")
REFERENCE = Part[Reference]("reference")  # optional
# Optional: what a task a pipeline can train adds (app/train/pipelining.py).
PIPELINE_BATCH = Part[PipelineBatch]("pipeline_batch")
PIPELINE_LOSS = Part[OutputLoss]("pipeline_loss")
DATASET_PREPROCESSOR = Part[DatasetPreprocessor]("preprocessor")  # optional
