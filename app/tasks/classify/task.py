"""Task `classify`: labelled rows (tables, images, text) -> a label and its probabilities."""

from __future__ import annotations

from app.evaluate.held_out import EVALUATE
from app.export.exporter import EXPORT
from app.pipeline.stages import SMOKE
from app.predict.actor import PREDICTOR
from app.registry import Task
from app.serve.control.builders import SERVER
from app.tasks.classify.evaluate import evaluate_classifier
from app.tasks.classify.export import EXPORT_PARTS
from app.tasks.classify.predict import ClassifierPredictor
from app.tasks.classify.replica import ClassifierApp
from app.tasks.classify.smoke import sample_infer
from app.tasks.classify.train import (
    classification_loss,
    cross_entropy,
    headline,
    labelled,
    validate_classifier,
)
from app.train.parts import HEADLINE, LOSS, PIPELINE_BATCH, PIPELINE_LOSS, VALIDATE


def spec() -> Task:
    return Task(
        name="classify",
        dataset_kinds=("image", "tabular", "text"),
        metrics=("val_loss", "val_accuracy"),
        parts=dict(
            [
                LOSS.of(classification_loss),
                PIPELINE_BATCH.of(labelled),
                PIPELINE_LOSS.of(cross_entropy),
                VALIDATE.of(validate_classifier),
                HEADLINE.of(headline),
                EVALUATE.of(evaluate_classifier),
                EXPORT.of(EXPORT_PARTS),
                SERVER.of(ClassifierApp),
                PREDICTOR.of(ClassifierPredictor),
                SMOKE.of(sample_infer),
            ]
        ),
    )
