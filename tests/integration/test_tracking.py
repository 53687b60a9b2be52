"""Experiment tracking and pictures on the session's trained digits run: TensorBoard events and
the MLflow run read back and checked against the train summary; evaluate's and export's PNGs."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from app.train.tracking import ARTIFACT_TAG, CHECKPOINT_TAG, SCALARS
from tests.integration.conftest import mlflow_uri

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def digits(trained):
    return trained("digits")


def assert_png(path: str, min_width: int = 400) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert min_width <= image.size[0] <= 2000 and 200 <= image.size[1] <= 1500
        image.verify()


def test_tensorboard_events_hold_every_epoch_of_the_summary(digits):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, summary = digits
    folder = summary["tensorboard"]
    assert folder == os.path.join(config.storage_path, summary["run_name"], "tensorboard")
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(folder))
    events = EventAccumulator(folder)
    events.Reload()
    history = summary["history"]
    assert [m["epoch"] for m in history] == [1, 2, 3, 4, 5]
    assert set(events.Tags()["scalars"]) == set(SCALARS.values())
    for key, tag in SCALARS.items():
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [m["epoch"] for m in history], tag
        # TensorBoard stores float32.
        assert [s.value for s in scalars] == pytest.approx([m[key] for m in history], rel=1e-6)
    # The summary's best checkpoint carries the same numbers as its epoch's events.
    best = next(m for m in history if m["epoch"] == summary["epoch"])
    assert best["val_accuracy"] == summary["metrics"]["val_accuracy"]


def test_mlflow_run_has_the_config_and_per_epoch_metrics(digits, workspace):
    from mlflow.tracking import MlflowClient

    config, summary = digits
    client = MlflowClient(mlflow_uri(workspace))
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == summary["run_name"]
    assert client.get_experiment(run.info.experiment_id).name == "digits"
    params = run.data.params
    assert params["train.epochs"] == "5" and params["model.name"] == config.model.name
    assert params["train.storage_path"] == config.train.storage_path
    assert run.data.tags[CHECKPOINT_TAG] == summary["checkpoint"]
    for key in SCALARS:
        logged = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in sorted(logged, key=lambda m: m.step)] == [1, 2, 3, 4, 5]
        by_step = {m.step: m.value for m in logged}
        assert [by_step[m["epoch"]] for m in summary["history"]] == pytest.approx(
            [m[key] for m in summary["history"]]
        )


def test_evaluate_draws_the_confusion_matrix_and_the_run_curves(digits):
    from app.evaluate.held_out import evaluate

    config, summary = digits
    result = evaluate(config, summary["checkpoint"])
    plots = result["plots"]
    assert plots == {
        "confusion_matrix": os.path.join(summary["checkpoint"], "confusion_matrix.png"),
        "training_curves": os.path.join(summary["checkpoint"], "training_curves.png"),
    }
    assert os.path.exists(os.path.join(summary["checkpoint"], "evaluation.json"))
    for path in plots.values():
        assert_png(path)


def test_export_draws_fp32_vs_int8_and_tags_the_mlflow_run(digits, workspace, monkeypatch):
    from mlflow.tracking import MlflowClient

    from app.export.exporter import export
    from app.runtime.artifact import open_artifact

    config, summary = digits
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri(workspace))
    quick = config.model_copy(
        update={
            "export": config.export.model_copy(
                update={"latency_repeats": 3, "parity_rows": 32, "calibration_batches": 1}
            )
        }
    )
    result = export(quick, summary["checkpoint"])
    picture = result["plots"]["quantization"]
    assert picture == os.path.join(result["artifact"], "quantization.png")
    assert_png(picture, min_width=800)
    assert "quantization.png" in open_artifact(result["artifact"]).manifest.files  # hashed
    run = MlflowClient(mlflow_uri(workspace)).get_run(summary["mlflow_run_id"])
    assert run.data.tags[ARTIFACT_TAG] == result["artifact"]
    assert run.data.metrics["export_int8_accuracy"] == result["report"]["accuracy"]["onnx_int8"]
