"""A task registered from tests/ alone (tests/toy_task.py) runs train -> evaluate -> export ->
serve with no change to app/: the stages ask the task, they do not know its name."""

from __future__ import annotations

import time

import pytest
import requests

from app.evaluate import evaluate
from app.export.exporter import export
from app.runtime import artifact as art
from app.tasks.classify.smoke import sample_body
from app.train.driver import train
from tests.integration.conftest import workload_config
from tests.s3_server import free_port

pytestmark = pytest.mark.integration
TOY = "tests.toy_task:SMOOTHED"


@pytest.fixture(scope="module")
def toy_run(prepared, workspace):
    from tests.integration.conftest import ensure_local_ray

    prepared("tabular")
    ensure_local_ray()
    config = workload_config(
        workspace,
        "tabular",
        "train.epochs=5",
        "train.log_every_steps=1000",
        "train.run_name=tabular-smoothed",
        f"train.task={TOY}",
        "train.checkpoint_metric=val_margin",  # a metric only the toy task reports
        "export.name=smoothed",
    )
    return config, train(config)


def test_a_toy_task_trains_with_its_own_loss_and_metrics(toy_run):
    _, summary = toy_run
    assert summary["task"] == TOY
    metrics = summary["metrics"]
    assert 0.0 < metrics["val_margin"] <= 1.0  # reported by the toy's own validation
    assert metrics["val_accuracy"] >= 0.9
    # Label smoothing (0.1 over 2 classes) keeps the loss above its floor of ~0.2 nats.
    assert metrics["train_loss"] > 0.15


def test_a_toy_task_is_evaluated_exported_and_served(toy_run, workspace):
    from ray import serve

    from app.serve.control.builders import run_local

    config, summary = toy_run
    assert evaluate(config, summary["checkpoint"])["metrics"]["accuracy"] >= 0.9
    uri = export(config, summary["checkpoint"])["artifact"]
    assert art.open_artifact(uri).schema["task"] == TOY

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        run_local([{"name": "smoothed", "artifact": uri}], config.serve.model_dump(mode="json"))
        url = f"http://127.0.0.1:{port}/v2/models/smoothed"
        deadline = time.time() + 60
        while requests.get(f"{url}/ready", timeout=5).status_code != 200:
            assert time.time() < deadline, "the toy task's model never became ready"
            time.sleep(0.5)
        body, expected = sample_body(config, rows=32)
        answer = requests.post(f"{url}/infer", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        labels = answer.json()["outputs"][0]["data"]
        assert sum(a == b for a, b in zip(labels, expected, strict=True)) >= 28
    finally:
        serve.shutdown()
