"""Experiment tracking: TensorBoard event files for every run, MLflow when it is configured.

- TensorBoard: rank 0 writes one scalar per metric per epoch (step = epoch) into
  `<train.storage_path>/<run_name>/tensorboard/`, beside the run's checkpoints. On an object store
  the events are written to a local folder and uploaded after every epoch (an event file is
  append-only, and object stores cannot append).
- MLflow, only when `MLFLOW_TRACKING_URI` is set where the train job runs: the driver opens (or,
  for a resumed run name, reopens) a run named after the train run in the experiment
  `MLFLOW_EXPERIMENT_NAME` (default: the workload) with the flattened config as params; rank 0
  logs the same metrics per epoch; the driver closes it with the run's status. The run id goes
  into every checkpoint's `meta.json`, so `jobs.export` tags the published artifact's URI onto it.

The tracking URI reaches the workers through the train loop's config, not their environment, so
a cluster started before it was set still logs. Tracking is a side channel: once training runs, a
tracking backend that fails costs a warning, never the run.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from app import storage
from app.config import Config, dump

log = logging.getLogger(__name__)
TENSORBOARD_DIR = "tensorboard"
URI_ENV, EXPERIMENT_ENV = "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"
RUN_NAME_TAG, ARTIFACT_TAG, CHECKPOINT_TAG = (
    "raytorch.run_name",
    "raytorch.artifact",
    "raytorch.checkpoint",
)
# Reported metric -> TensorBoard tag ("section/name": TensorBoard groups by the prefix). MLflow
# gets the metric's own name.
SCALARS = {
    "train_loss": "loss/train",
    "val_loss": "loss/val",
    "val_accuracy": "accuracy/val",
    "learning_rate": "optim/learning_rate",
    "samples_per_second": "throughput/samples_per_second",
    "data_wait_fraction": "throughput/data_wait_fraction",
    "epoch_seconds": "throughput/epoch_seconds",
}
MLFLOW_PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"train": {"lr": 0.002}}` -> `{"train.lr": "0.002"}`: the config as MLflow params,
    named like the command-line overrides."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)
    return flat


# --- MLflow on the driver ---------------------------------------------------------------------


@dataclass(frozen=True)
class MlflowRun:
    """The MLflow run a train run logs to: its tracking URI and run id."""

    uri: str
    run_id: str


def mlflow_uri() -> str | None:
    return os.environ.get(URI_ENV) or None


def start_mlflow_run(config: Config, run_name: str) -> str | None:
    """The MLflow run id for this train run (None without `MLFLOW_TRACKING_URI`): an existing
    run tagged with the same run name is reopened (the train run resumes), else a new one is
    created with the config as params. Fails before training when the backend is unreachable."""
    uri = mlflow_uri()
    if uri is None:
        return None
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    name = os.environ.get(EXPERIMENT_ENV) or config.workload
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    quoted = run_name.replace("'", "\\'")
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{quoted}'", max_results=1
    )
    if found:
        run_id = found[0].info.run_id
        # Params are immutable in MLflow: a resumed run keeps those it started with.
        client.update_run(run_id, status="RUNNING")
        log.info("train: MLflow run %s (resumed) at %s", run_id, uri)
        return run_id
    run = client.create_run(experiment_id, run_name=run_name, tags={RUN_NAME_TAG: run_name})
    params = [Param(k, v) for k, v in sorted(flatten(dump(config)).items())]
    for i in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
        client.log_batch(run.info.run_id, params=params[i : i + MLFLOW_PARAMS_PER_CALL])
    log.info("train: MLflow run %s in experiment %r at %s", run.info.run_id, name, uri)
    return run.info.run_id


def finish_mlflow_run(run_id: str | None, summary: dict[str, Any] | None) -> None:
    """Close the run: FINISHED with the best checkpoint tagged, or FAILED (summary None)."""
    if run_id is None:
        return
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(mlflow_uri())
        if summary is not None:
            client.set_tag(run_id, CHECKPOINT_TAG, summary["checkpoint"])
        client.set_terminated(run_id, "FINISHED" if summary is not None else "FAILED")
    except Exception as e:  # noqa: BLE001 - the run's own outcome matters more
        log.warning("train: could not close MLflow run %s: %s", run_id, first_line(e))


def tag_artifact(
    run_id: str | None, artifact_uri: str, quality: Any, report: dict[str, Any]
) -> None:
    """Export: the published artifact's URI and its int8 figures onto the train run: the
    task's quality metric (`export_int8_<key>`: accuracy, perplexity, recall_at_1) and the
    size ratio. `quality` is the task's `Quality` (app/export/exporter.py)."""
    uri = mlflow_uri()
    if run_id is None or uri is None:
        return
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        client.set_tag(run_id, ARTIFACT_TAG, artifact_uri)
        client.log_metric(run_id, f"export_int8_{quality.key}", quality.values["onnx_int8"])
        client.log_metric(run_id, "export_int8_size_ratio", report["size_ratio_int8"])
    except Exception as e:  # noqa: BLE001 - the artifact is already published
        log.warning("export: could not tag MLflow run %s: %s", run_id, first_line(e))


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# --- the per-epoch writer on rank 0 -------------------------------------------------------------


class EpochTracker:
    """Rank 0's per-epoch sink: TensorBoard scalars, and MLflow metrics when the driver opened
    a run (`mlflow` = {"uri", "run_id"}, from the train loop's config)."""

    def __init__(self, run_dir: str, mlflow: MlflowRun | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.dest = storage.join(run_dir, TENSORBOARD_DIR)
        self.remote = not storage.is_local(run_dir)
        self.local = (
            tempfile.mkdtemp(prefix="raytorch-tb-")
            if self.remote
            else storage.filesystem(self.dest)[1]
        )
        self.writer = SummaryWriter(log_dir=self.local)
        self.mlflow = mlflow
        self.client = None
        if mlflow:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(mlflow.uri)

    def log(self, metrics: dict[str, Any]) -> None:
        step = int(metrics["epoch"])
        logged = {k: float(metrics[k]) for k in SCALARS if k in metrics}
        for key, value in logged.items():
            self.writer.add_scalar(SCALARS[key], value, step)
        self.writer.flush()
        if self.remote:
            self.upload(step)
        if self.client is not None and self.mlflow:
            self.log_mlflow(logged, step)

    def log_mlflow(self, logged: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        assert self.client is not None and self.mlflow
        now = int(time.time() * 1000)
        try:
            self.client.log_batch(
                self.mlflow.run_id,
                metrics=[Metric(k, v, now, step) for k, v in sorted(logged.items())],
            )
        except Exception as e:  # noqa: BLE001 - tracking must not end a training run
            log.warning("MLflow: epoch %d not logged: %s", step, first_line(e))

    def upload(self, step: int | None = None) -> None:
        """Copy the event files to the run folder on the object store (whole files: small). A
        failure is a warning: the next epoch uploads the whole file again."""
        try:
            for name in os.listdir(self.local):
                storage.upload_file(os.path.join(self.local, name), storage.join(self.dest, name))
        except Exception as e:  # noqa: BLE001 - tracking must not end a training run
            when = "at the end" if step is None else f"after epoch {step}"
            log.warning("TensorBoard: events not uploaded %s: %s", when, first_line(e))

    def close(self) -> None:
        self.writer.close()
        if self.remote:
            self.upload()
            shutil.rmtree(self.local, ignore_errors=True)
