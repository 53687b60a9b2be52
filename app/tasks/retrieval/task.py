"""Task `retrieval`: pictures and their captions -> a dual encoder whose image and text
embeddings share one space, served as OpenAI embeddings and searched through a vector index."""

from __future__ import annotations

from app.evaluate.held_out import EVALUATE
from app.export.exporter import EXPORT
from app.pipeline.stages import FOLLOW_UP, SMOKE
from app.predict.actor import PREDICTOR
from app.registry import Task
from app.serve.control.builders import SERVER
from app.serve.http.api import ROUTES
from app.tasks.retrieval.evaluate import evaluate_retrieval
from app.tasks.retrieval.export import EXPORT_PARTS
from app.tasks.retrieval.http.router import router
from app.tasks.retrieval.predict import EmbeddingPredictor
from app.tasks.retrieval.replica import EmbeddingApp
from app.tasks.retrieval.smoke import index_val_pictures, sample_embedding
from app.tasks.retrieval.train import KS, contrastive_loss, headline, validate_retrieval
from app.train.parts import HEADLINE, LOSS, VALIDATE

METRICS = tuple(f"val_{d}_r{k}" for d in ("i2t", "t2i") for k in KS)


def spec() -> Task:
    return Task(
        name="retrieval",
        dataset_kinds=("image_text",),
        metrics=("val_loss", *METRICS, "val_rsum"),
        checkpoint=("val_rsum", "max"),
        parts=dict(
            [
                LOSS.of(contrastive_loss),
                VALIDATE.of(validate_retrieval),
                HEADLINE.of(headline),
                EVALUATE.of(evaluate_retrieval),
                EXPORT.of(EXPORT_PARTS),
                SERVER.of(EmbeddingApp),
                ROUTES.of(router),
                PREDICTOR.of(EmbeddingPredictor),
                SMOKE.of(sample_embedding),
                FOLLOW_UP.of(index_val_pictures),
            ]
        ),
    )
