"""Task `lm`: a text corpus, tokenized and packed at prepare -> a causal language model that
generates text."""

from __future__ import annotations

from app.evaluate.held_out import EVALUATE
from app.export.exporter import EXPORT
from app.pipeline.stages import SMOKE
from app.predict.actor import PREDICTOR
from app.registry import Task
from app.serve.control.builders import SERVER
from app.serve.http.api import ROUTES
from app.tasks.lm.evaluate import evaluate_language_model
from app.tasks.lm.export import EXPORT_PARTS
from app.tasks.lm.http.router import router
from app.tasks.lm.predict import CompletionPredictor
from app.tasks.lm.replica import LMApp
from app.tasks.lm.smoke import sample_completion
from app.tasks.lm.train import (
    dataset_preprocessor,
    headline,
    next_token_loss,
    reference_metrics,
    shifted,
    token_loss,
    validate_lm,
)
from app.train.parts import (
    DATASET_PREPROCESSOR,
    HEADLINE,
    LOSS,
    PIPELINE_BATCH,
    PIPELINE_LOSS,
    REFERENCE,
    VALIDATE,
)


def spec() -> Task:
    return Task(
        name="lm",
        dataset_kinds=("tokens",),
        metrics=("val_loss", "val_perplexity", "val_token_accuracy", "baseline_perplexity"),
        generates=True,
        checkpoint=("val_loss", "min"),
        parts=dict(
            [
                DATASET_PREPROCESSOR.of(dataset_preprocessor),
                LOSS.of(next_token_loss),
                PIPELINE_BATCH.of(shifted),
                PIPELINE_LOSS.of(token_loss),
                VALIDATE.of(validate_lm),
                HEADLINE.of(headline),
                REFERENCE.of(reference_metrics),
                EVALUATE.of(evaluate_language_model),
                EXPORT.of(EXPORT_PARTS),
                SERVER.of(LMApp),
                ROUTES.of(router),
                PREDICTOR.of(CompletionPredictor),
                SMOKE.of(sample_completion),
            ]
        ),
    )
