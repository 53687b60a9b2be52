"""A tiny causal language model trained on a local Ray (DDP, 2 workers) on a small real corpus:
the loss falls, the summary and evaluate report perplexity beside the unigram baseline, export
publishes an int8 artifact through the LM gate."""

from __future__ import annotations

import math
import os

import pytest

from app.evaluate.held_out import evaluate
from app.export.exporter import export
from app.pipeline.stages import prepare
from app.train.driver import train
from tests.conftest import REPO, make_config
from tests.integration.test_train import run_metrics

pytestmark = pytest.mark.integration

TINY = [
    # The email package of this Python's standard library: about 0.36 MB of real text.
    "data.path={stdlib}/email/*.py",
    "data.val_fraction=0.15",
    "model.dim=64",
    "model.layers=2",
    "model.heads=2",
    "model.ff_dim=128",
    "model.max_length=32",
    "model.vocab_size=512",
    "train.epochs=2",
    "train.max_steps_per_epoch=6",
    "train.batch_size=16",
    "train.lr=0.01",
    "train.run_name=lm-tiny",
]


@pytest.fixture(scope="module")
def tiny_lm(workspace, ray_local_module):
    config = make_config(workspace / "lm", *TINY, path=REPO / "configs" / "lm.yaml")
    prepare(config)
    return config, train(config)


@pytest.fixture(scope="module")
def ray_local_module():
    from tests.integration.conftest import ensure_local_ray

    ensure_local_ray()


def test_a_finished_run_leaves_no_train_controller_behind(tiny_lm):
    """train() returns once its TrainController is gone: a job that shuts Ray down right after
    (every jobs.* entry point) leaves no process of it."""
    from app.ray_private import wait_for_job_actors

    assert wait_for_job_actors("TrainController", timeout_s=0) == []


def test_tiny_lm_learns_beyond_the_unigram_start(tiny_lm):
    config, summary = tiny_lm
    metrics = summary["metrics"]
    history = run_metrics(os.path.join(config.storage_path, summary["run_name"]))
    assert [m["epoch"] for m in history] == [1, 2]
    assert [m["step"] for m in history] == [6, 12]  # the step budget bounds every epoch
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    # An untrained model is near uniform over the vocabulary (perplexity ~512).
    assert metrics["val_perplexity"] == pytest.approx(math.exp(metrics["val_loss"]))
    assert metrics["val_perplexity"] < 512
    assert metrics["baseline_perplexity"] > 1


def test_evaluate_reports_the_same_quantities(tiny_lm):
    config, summary = tiny_lm
    result = evaluate(config, summary["checkpoint"])["metrics"]
    assert result["split"] == "val"
    # Both score every val token of the same split with the same unigram fit.
    assert result["baseline_perplexity"] == pytest.approx(summary["metrics"]["baseline_perplexity"])
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert result["tokens"] > 0
    assert os.path.exists(os.path.join(summary["checkpoint"], "evaluation.json"))


def test_export_of_the_trained_model_passes_the_lm_gate(tiny_lm):
    config, summary = tiny_lm
    report = export(config, summary["checkpoint"])["report"]
    assert report["task"] == "lm"
    assert report["perplexity_increase"] <= config.export.max_perplexity_increase
    assert report["greedy"]["token_agreement"] >= config.export.min_greedy_agreement
