"""Elastic training on a multi-node Ray cluster whose nodes share no disk.

The nodes (ray.cluster_utils.Cluster) each get their own HOME and temp folder, and every
location the run uses is `s3://` on an S3 server (moto) on 127.0.0.1; the credentials reach each
node as its environment. The run (`train.num_workers: [1, 2]`) starts on the one node there is,
grows when a second joins, shrinks back when that node is lost (the rank on it dies: the run
resumes from its last registered checkpoint on the survivor) and ends with the model a
fixed-size run makes, every epoch trained once. In `make test-all` the artifact is then
exported, deployed and used for batch inference on the same cluster, all through the object
store.

One machine cannot hide one node's disk from another (and root writes through any mode bits),
so what is checked is that nothing of the run lands on local disk outside the nodes' temp
folders: the repo's outputs/ is left as it was.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests

from app import storage
from app.pipeline.stages import prepare
from app.train.driver import train
from tests import fault_hooks
from tests.conftest import REPO
from tests.integration.conftest import multinode_cluster, workload_config
from tests.integration.test_faults import registered_epoch
from tests.s3_server import free_port, moto_s3

pytestmark = pytest.mark.integration
EPOCHS = 8
GROW_AT, SHRINK_AT = 3, 6  # epochs held while the test adds, then removes, a node
AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3")


def wait_until(check, timeout: float, alive, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout}s (training alive: {alive()})")


def node_env(root: Path, name: str) -> dict[str, str]:
    """A node's own HOME and temp folder; the object store's endpoint and credentials and the
    cluster's Ray token as its environment (a node's HOME holds no ~/.ray/auth_token)."""
    import os

    home, tmp = root / name / "home", root / name / "tmp"
    home.mkdir(parents=True)
    tmp.mkdir()
    # This machine's Ray token (what ~/.ray/auth_token holds), for a node whose HOME has none.
    shared = {k: os.environ[k] for k in AWS} | {"RAY_AUTH_TOKEN": ray_token()}
    return {"HOME": str(home), "TMPDIR": str(tmp), **shared}


def ray_token() -> str:
    """The token `ray get-auth-token` gives (made and saved on first use)."""
    ray_cli = Path(sys.executable).with_name("ray")
    done = subprocess.run(
        [str(ray_cli), "get-auth-token", "--generate"], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def outputs_listing() -> list[str]:
    outputs = REPO / "outputs"
    return sorted(str(p) for p in outputs.rglob("*")) if outputs.exists() else []


@pytest.fixture(scope="module")
def elastic_run(workspace, tmp_path_factory):
    """The run holds at the start of epochs 3 and 6 (a test hook) so the cluster changes at
    known points: a node joins while epoch 3 waits on one worker, and the test lets it go once
    the group has restarted on two; the node is removed while epoch 6 waits on two, after
    epoch 5's checkpoint is registered. The cluster stays up for the module's tests."""
    import ray
    from ray import serve

    tmp_path = tmp_path_factory.mktemp("elastic")
    ray.shutdown()  # needs its own multi-node cluster; later tests re-init a local one
    with moto_s3() as bucket, pytest.MonkeyPatch.context() as env:
        s3_root = f"{bucket}/{uuid.uuid4().hex[:8]}"
        # A restart right after the node loss may first try two workers (Ray's view of free
        # resources lags by up to 20 s): let each such try time out in 10 s, not 60.
        env.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")
        config = workload_config(
            workspace,
            "tabular",
            f"data.output={s3_root}/data",
            f"train.storage_path={s3_root}/runs",
            f"export.registry={s3_root}/registry",
            f"train.epochs={EPOCHS}",
            "train.num_workers=[1,2]",
            "train.cpus_per_worker=2",
            "train.elastic_resize_interval_s=1",
            "train.max_failures=2",
            "train.run_name=tabular-elastic",
            "export.latency_repeats=3",
            "export.parity_rows=32",
        )
        before = outputs_listing()
        # The head (no CPUs: it runs no worker) is this machine, the driver's, with its HOME.
        cluster = multinode_cluster()
        # Room for one worker a node (2 CPUs each); after training, the survivor's 2 CPUs hold
        # jobs.predict (Ray Data's file listing alone asks for a whole CPU) and then Serve.
        cluster.add_node(num_cpus=2, env_vars=node_env(tmp_path, "survivor"))
        try:
            ray.init(address=cluster.address, log_to_driver=False)
            cluster.wait_for_nodes()
            summary = grow_and_shrink(config, cluster, tmp_path)
            yield {
                "config": config, "summary": summary, "s3_root": s3_root, "tmp_path": tmp_path,
                "before": before,
            }  # fmt: skip
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()


def grow_and_shrink(config, cluster, tmp_path: Path) -> dict:
    """Train while a node joins at epoch 3 and leaves at epoch 6; the run's summary."""
    run_dir = storage.join(config.storage_path, "tabular-elastic")
    for epoch in (GROW_AT, SHRINK_AT):  # tests/fault_hooks.py, installed on every node
        fault_hooks.hold(run_dir, epoch)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["summary"] = train(config)
        except Exception as e:  # surfaced by the assertion below
            outcome["error"] = e

    def held(epoch: int, world: int) -> bool:
        return fault_hooks.held(run_dir, epoch, world)

    prepare(config)
    trainer = threading.Thread(target=run)
    trainer.start()
    alive = trainer.is_alive
    wait_until(lambda: held(GROW_AT, 1), 180, alive, "epoch 3 never held on one worker")
    joined = cluster.add_node(num_cpus=2, env_vars=node_env(tmp_path, "joined"))
    wait_until(lambda: held(GROW_AT, 2), 120, alive, "the group never grew to two")
    fault_hooks.release(run_dir, GROW_AT)
    wait_until(lambda: held(SHRINK_AT, 2), 120, alive, "epoch 6 never held on two")
    wait_until(lambda: registered_epoch(run_dir) == SHRINK_AT - 1, 60, alive, "no checkpoint")
    cluster.remove_node(joined)  # kills its raylet and the rank on it
    fault_hooks.release(run_dir, SHRINK_AT)
    trainer.join(timeout=300)
    assert not trainer.is_alive(), "training did not finish after the node loss"
    assert "error" not in outcome, outcome.get("error")
    return outcome["summary"]


def test_an_elastic_run_on_nodes_sharing_no_disk_grows_and_shrinks(elastic_run):
    summary, s3_root = elastic_run["summary"], elastic_run["s3_root"]
    sizes = summary["num_workers_history"]
    assert [(s["workers"], s["from_epoch"]) for s in sizes] == [(1, 1), (2, 3), (1, 6)], sizes
    assert summary["num_workers"] == 1  # the size it ended at
    assert sizes[1]["reason"].startswith("grew 1 -> 2"), sizes
    assert sizes[2]["reason"].startswith("shrank 2 -> 1"), sizes
    # Both restarts began right after a registered checkpoint: every epoch appears once in the
    # history, none trained twice past its checkpoint, none skipped.
    assert summary["resume_history"] == [GROW_AT, SHRINK_AT]
    assert [h["epoch"] for h in summary["history"]] == list(range(1, EPOCHS + 1))
    assert summary["metrics"]["val_accuracy"] >= 0.9
    assert summary["checkpoint"].startswith(f"{s3_root}/runs/")
    assert outputs_listing() == elastic_run["before"]  # nothing written to local outputs/


@pytest.mark.slow
def test_the_elastic_runs_model_is_exported_served_and_predicted_through_the_object_store(
    elastic_run,
):
    """The same artifact answers the same row the same way online and in batch, on nodes that
    share no disk (every location `s3://`)."""
    run = elastic_run
    artifact, served, predicted = export_serve_predict(
        run["config"], run["summary"], run["tmp_path"], run["s3_root"]
    )
    assert artifact.startswith(f"{run['s3_root']}/registry/")
    assert str(served) == str(predicted)
    assert outputs_listing() == run["before"]


def export_serve_predict(config, summary, tmp_path, root: str) -> tuple[str, str, str]:
    """Export the run's checkpoint to the S3 registry, serve it and run jobs.predict over an
    S3 input on the cluster; one row's label from the endpoint and from the batch output."""
    from ray import serve

    from app.export.exporter import export
    from app.predict.driver import predict
    from app.predict.write import verify_output
    from app.runtime.artifact import open_artifact
    from app.serve.control.builders import run_local

    uri = export(config, summary["checkpoint"])["artifact"]
    columns = open_artifact(uri).schema["feature_columns"]
    rng = np.random.default_rng(0)
    rows = rng.normal(1.0, 0.2, (64, len(columns))) * rng.uniform(0.1, 100, len(columns))
    table = pa.table({"id": np.arange(64), **{c: rows[:, j] for j, c in enumerate(columns)}})
    local = tmp_path / "input.parquet"
    pq.write_table(table, local)
    storage.upload_file(str(local), f"{root}/scoring/part-0.parquet")
    output = f"{root}/predictions"
    predict(config, uri, f"{root}/scoring", output)
    manifest = verify_output(output)
    parts = [storage.filesystem(storage.join(output, f.file)) for f in manifest.files]
    table = pa.concat_tables([pq.read_table(path, filesystem=fs) for fs, path in parts])
    assert manifest.rows["output"] == 64
    predicted = dict(zip(table["id"].to_pylist(), table["label"].to_pylist(), strict=True))[0]

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    run_local([{"name": "tabular", "artifact": uri}], config.serve.model_dump(mode="json"))
    body = {
        "inputs": [
            {
                "name": "features",
                "datatype": "FP32",
                "shape": [1, len(columns)],
                "data": rows[0].tolist(),
            }
        ]
    }
    deadline = time.monotonic() + 120
    while True:
        r = requests.post(f"http://127.0.0.1:{port}/v2/models/tabular/infer", json=body, timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    return uri, outputs["label"]["data"][0], predicted
