"""The pipeline through Ray's own entry point: `ray job submit` to a token-protected cluster.

Checks the job ends SUCCEEDED through the Jobs API (exporting an AOTInductor program beside ONNX
and serving `serve.variant: auto`), the deployed endpoint answers correctly, the
Jobs API refuses a missing (401) and a wrong (403) token, and the project's training and serving
metrics reach Ray's Prometheus export endpoint.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import requests

from tests.conftest import REPO
from tests.e2e.conftest import DASHBOARD, SERVE, job_env, wait_for

pytestmark = pytest.mark.e2e
METRICS = "http://127.0.0.1:8080/metrics"
WANTED = [
    "ray_raytorch_val_accuracy",
    "ray_raytorch_data_wait_fraction",
    "ray_raytorch_samples_per_second",
    "ray_raytorch_requests_total",
    "ray_raytorch_request_latency_ms",
    "ray_raytorch_batch_size",
]
# Metric names seen on the export endpoint while the pipeline ran. Training gauges live in the
# train workers, and Ray stops exporting a worker's metrics some time after it exits, so they are
# scraped during the run, as Prometheus would.
SEEN: set[str] = set()


def scrape() -> None:
    try:
        text = requests.get(METRICS, timeout=5).text
    except requests.RequestException:
        return
    SEEN.update(name for name in WANTED if name in text)


def jobs_api(path: str, token: str | None) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.get(f"{DASHBOARD}{path}", headers=headers, timeout=10)


def test_jobs_api_refuses_missing_and_wrong_tokens(cluster):
    assert jobs_api("/api/jobs/", None).status_code == 401
    assert jobs_api("/api/jobs/", "not-the-token").status_code == 403
    assert jobs_api("/api/jobs/", cluster["token"]).status_code == 200


def test_pipeline_submitted_with_ray_job_submit(cluster, tmp_path):
    summary_file = tmp_path / "pipeline.json"
    overrides = [
        f"data.output={tmp_path}/data",
        f"train.storage_path={tmp_path}/runs",
        f"export.registry={tmp_path}/registry",
        "export.name=digits-job",
        "train.epochs=4",
        # The README's programs command, on digits: a `.pt2` verified beside ONNX, `auto` served
        # (ExecuTorch's programs are checked on the integration tier's tabular artifact).
        "export.formats=[onnx,aoti]",
        "serve.variant=auto",
    ]
    submit = subprocess.run(
        [
            str(REPO / ".venv/bin/ray"),
            "job",
            "submit",
            "--address",
            DASHBOARD,
            "--no-wait",
            "--runtime-env",
            "cluster/runtime_env.yaml",
            "--working-dir",
            ".",
            "--",
            "python",
            "-m",
            "jobs.pipeline",
            "--config",
            "configs/digits.yaml",
            "--summary-file",
            str(summary_file),
            *overrides,
        ],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submit.returncode == 0, submit.stderr[-2000:]
    job_id = next(
        w.strip("'")
        for w in submit.stdout.split() + submit.stderr.split()
        if w.strip("'").startswith("raysubmit_")
    )

    def finished():
        scrape()
        status = jobs_api(f"/api/jobs/{job_id}", cluster["token"]).json()["status"]
        return status if status in ("SUCCEEDED", "FAILED", "STOPPED") else None

    status = wait_for(finished, 900, 3, "the pipeline job to finish")
    logs = jobs_api(f"/api/jobs/{job_id}/logs", cluster["token"]).json()["logs"]
    assert status == "SUCCEEDED", logs[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["url"] == SERVE
    assert set(summary["stages"]) == {"prepare", "train", "evaluate", "export", "deploy"}
    assert sum(summary["stages"]["prepare"]["rows"].values()) == 1797
    assert summary["stages"]["train"]["metrics"]["val_accuracy"] >= 0.95
    report = summary["stages"]["export"]["report"]
    assert report["programs"]["aoti"]["published"], report["programs"]
    metadata = requests.get(f"{SERVE}/v2/models/digits-job", timeout=30).json()
    assert metadata["parameters"]["variant"] == report["serving"]["auto"]

    # The endpoint answers correctly: the sample request's label is the true one, and a val
    # batch through the live endpoint is as accurate as the export report says.
    sample = summary["sample_request"]
    assert sample["predicted"] == sample["expected"]
    import pandas as pd

    from app.data.prepare import read_manifest, split_files

    output = f"{tmp_path}/data"
    files = split_files(output, read_manifest(output), "val")  # through the manifest
    frame = pd.concat([pd.read_parquet(f) for f in files])
    x = [list(map(float, row)) for row in frame["image"][:100]]
    r = requests.post(f"{SERVE}/v1/models/digits-job:predict", json={"instances": x}, timeout=30)
    assert r.status_code == 200, r.text
    predicted = [p["label"] for p in r.json()["predictions"]]
    accuracy = sum(p == t for p, t in zip(predicted, frame["label"][:100], strict=True)) / 100
    assert accuracy >= 0.93


def test_training_and_serving_metrics_reach_prometheus_export(cluster):
    def all_seen():
        scrape()
        return set(WANTED) <= SEEN

    try:
        wait_for(all_seen, 60, 2, f"metrics on {METRICS}")
    except AssertionError:
        raise AssertionError(f"never seen on {METRICS}: {sorted(set(WANTED) - SEEN)}") from None
