"""A task registered from tests/ alone (tests/toy_task.py), with its own kind of data and its own
route, runs prepare -> train -> evaluate -> export -> serve with no change to app/: the stages
ask the task and the kind's table, they know neither's name."""

from __future__ import annotations

import time

import numpy as np
import pytest
import requests

from app.data.prepare import read_manifest
from app.evaluate.held_out import evaluate
from app.export.exporter import export
from app.pipeline.stages import prepare
from app.runtime import artifact as art
from app.tasks.classify.smoke import sample_body
from app.train.driver import train
from tests.conftest import REPO, make_config
from tests.s3_server import free_port

pytestmark = pytest.mark.integration
TOY, CLIPPED = "tests.toy_task:SMOOTHED", "tests.toy_task:Clipped"


@pytest.fixture(scope="module")
def toy_run(workspace):
    from tests.integration.conftest import ensure_local_ray

    ensure_local_ray()
    config = make_config(
        workspace / "toy",
        f"data.kind={CLIPPED}",
        "train.epochs=5",
        "train.log_every_steps=1000",
        "train.run_name=tabular-smoothed",
        f"train.task={TOY}",
        "train.checkpoint_metric=val_margin",  # a metric only the toy task reports
        "export.name=smoothed",
        "serve.variant=fp32",  # int8 clamps inputs to its calibrated range: only the kind clips
        path=REPO / "configs" / "tabular.yaml",
    )
    prepare(config)
    return config, train(config)


def test_a_toy_task_trains_with_its_own_loss_and_metrics(toy_run):
    config, summary = toy_run
    assert read_manifest(config.data_output).kind == CLIPPED  # prepared as the toy's own kind
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
    artifact = art.open_artifact(uri)
    assert artifact.schema["task"] == TOY
    assert type(artifact.preprocessor).__name__ == "Clipped"  # the kind travels in the artifact

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
        check_clipped_and_margin(url, artifact, body["inputs"][0]["data"][:4])
    finally:
        serve.shutdown()


def check_clipped_and_margin(url: str, artifact, rows: list[list[float]]) -> None:
    """The replica runs the toy's kind: two rows 4 and 8 standard deviations out, which the
    model tells apart unclipped, answer alike (each feature at the clip); the toy's own route
    answers each row's margin from the same probabilities the model gives."""
    state = artifact.preprocessor.state
    mean, std = np.asarray(state["mean"]), np.asarray(state["std"])
    far = [(mean + 4 * std).tolist(), (mean + 8 * std).tolist()]
    unclipped = art.run_logits(
        artifact.session("fp32", 1),
        {"x": np.float32([[4.0], [8.0]]) * np.ones((1, len(mean)), np.float32)},
    )
    assert not np.allclose(unclipped[0], unclipped[1])
    v1 = url.replace("/v2/", "/v1/")
    answer = requests.post(f"{v1}:predict", json={"instances": far}, timeout=30)
    assert answer.status_code == 200, answer.text
    first, second = (p["probabilities"] for p in answer.json()["predictions"])
    assert first == second
    margins = requests.post(f"{url}/margin", json={"instances": rows}, timeout=30)
    assert margins.status_code == 200, margins.text
    predicted = requests.post(f"{v1}:predict", json={"instances": rows}, timeout=30).json()
    for got, row in zip(margins.json()["margins"], predicted["predictions"], strict=True):
        top = sorted(row["probabilities"].values())
        assert got == pytest.approx(top[-1] - top[-2], abs=1e-6)
