"""Task `lm`: next-token loss and perplexity on held-out tokens beside the unigram baseline."""

from __future__ import annotations

import logging
from typing import Any

from app import storage
from app.config import Config
from app.evaluate.held_out import EVALUATION_FILE
from app.train.checkpoint import LoadedCheckpoint

log = logging.getLogger(__name__)


def evaluate_language_model(
    config: Config, checkpoint_uri: str, loaded: LoadedCheckpoint, split: str
) -> dict[str, Any]:
    """Task `lm`: next-token loss and perplexity beside the unigram baseline's (app/tasks/lm/train.py)."""
    from app.tasks.lm.train import evaluate_lm

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
