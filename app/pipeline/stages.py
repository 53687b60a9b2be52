"""Pipeline: prepare -> train -> evaluate -> export -> deploy -> the task's follow-up stages
(retrieval: embed the val pictures, index them, deploy the index) -> one sample request.

Each stage's output feeds the next by URI, exactly as the separate jobs would pass them.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from app.config import Config
from app.data.pieces import Tasks
from app.data.prepare import prepare_dataset, read_manifest
from app.ray_runtime import connect_ray
from app.registry import Part, run_task


class Smoke(Protocol):
    """One real request to the deployed model (jobs.pipeline's last step): its summary."""

    def __call__(
        self, config: Config, url: str, model: str, headers: dict[str, str], /
    ) -> dict[str, Any]: ...


SMOKE = Part[Smoke]("smoke")


class FollowUp(Protocol):
    """Stages a task runs once its model serves, given the pipeline's stages so far: their
    summaries by stage name."""

    def __call__(self, config: Config, stages: dict[str, Any], /) -> dict[str, Any]: ...


FOLLOW_UP = Part[FollowUp]("follow_up")

log = logging.getLogger(__name__)


def prepare(config: Config, tasks: Tasks | None = None) -> dict[str, Any]:
    """jobs.prepare: the data layer's `prepare_dataset` with the run's pretrained folders (their
    tokenizer, and the check that they take the data) handed down from the model families."""
    from app.models.families import Bases  # torch: the driver only

    return prepare_dataset(config, Bases(config.model), tasks)


def pipeline(config: Config) -> dict[str, Any]:
    from app.evaluate.held_out import evaluate
    from app.export.exporter import export
    from app.serve.control.deploy import deploy
    from app.train.driver import train

    connect_ray(require_cluster=True)  # deploy needs a cluster: find out before any work
    stages: dict[str, Any] = {}
    stages["prepare"] = prepare(config)
    stages["train"] = train(config)
    checkpoint = stages["train"]["checkpoint"]
    stages["evaluate"] = evaluate(config, checkpoint)
    stages["export"] = export(config, checkpoint)
    stages["deploy"] = deploy(config, stages["export"]["artifact"])
    task = run_task(config.train.task, read_manifest(config.data_output).kind)
    if task.has(FOLLOW_UP):
        stages |= task.part(FOLLOW_UP)(config, stages)
    url = stages["deploy"]["url"]
    sample = sample_request(config, url, stages["deploy"]["model"])
    return {"stage": "pipeline", "url": url, "stages": stages, "sample_request": sample}


def sample_request(config: Config, url: str, model: str) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(config.serve.api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    task = run_task(config.train.task, read_manifest(config.data_output).kind)
    return task.part(SMOKE)(config, url, model, headers)
