"""A task defined outside app/: classification with label smoothing that also reports how sure
the model is (`val_margin`), on its own kind of data (`Clipped`: a table whose standardised
features are clipped to +-3, in training and serving alike) and with its own route
(`POST /v2/models/{name}/margin`). It proves a new task is one registry entry: prepare, train,
export and serve take it by `data.kind=tests.toy_task:Clipped` and
`train.task=tests.toy_task:SMOOTHED` with no change to app/."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from fastapi import APIRouter, Request

from app.data.kinds.tabular import Tabular
from app.registry import Task
from app.runtime.types import InferRequest
from app.serve.http.api import ROUTES
from app.serve.http.clients import INFO_FRESH_S
from app.serve.http.gate import body
from app.serve.http.routes.common import config, models
from app.serve.http.routes.v1 import decode_v1
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


CLIP = 3.0  # standard deviations


class Clipped(Tabular):
    """A table's rows with each standardised feature clipped to +-CLIP: an outlier cannot push
    the model further than a row at the clip."""

    def features(self, raw: Any) -> dict[str, np.ndarray]:
        return {k: np.clip(v, -CLIP, CLIP) for k, v in super().features(raw).items()}


router = APIRouter()


@router.post("/v2/models/{name}/margin")
async def margin(name: str, request: Request):
    """`{"instances": [...]}` -> how far each row's top class is ahead of the second."""
    m = models(request)
    info = await m.info(name, INFO_FRESH_S)
    rows = decode_v1(await body(request, inputs=info.inputs), config(request).max_request_rows)
    result = await m.infer(name, InferRequest(instances=rows))
    top2 = np.sort(result.probabilities, axis=1)[:, -2:]
    return {"model_name": name, "margins": (top2[:, 1] - top2[:, 0]).tolist()}


# The classifier's evaluation, export, replica and smoke request; its own loss, validation, log
# line and route.
SMOOTHED = Task(
    name="smoothed",
    dataset_kinds=("tabular", "tests.toy_task:Clipped"),
    metrics=("val_loss", "val_accuracy", "val_margin"),
    parts={
        **classify.spec().parts,
        **dict([LOSS.of(smoothed_loss), VALIDATE.of(validate_with_margin), HEADLINE.of(headline)]),
        **dict([ROUTES.of(router)]),
    },
)
