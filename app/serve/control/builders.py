"""The Serve application builders: one application per model, plus one index application.

    - name: models-digits              # <serve.app_name>-<model>
      route_prefix: /v2/models/digits
      import_path: app.serve.control.builders:build_model_app
      args: {model: {name: digits, artifact: <artifact folder or <registry>/<name>/latest>},
             serve: {...ServeConfig...}}
    - name: models                     # serve.app_name
      route_prefix: /
      import_path: app.serve.control.builders:build_index_app
      args: {models: [digits, ...], serve: {...ServeConfig...}}

A model's application is a single deployment (`model-<name>`) that parses the HTTP request and
owns the model's ONNX Runtime session: Serve's proxy (or HAProxy, in high-throughput mode) hands
it the request, and nothing else is in the path. Each model therefore has its own rolling
updates, rollback, variant (`user_config`) and autoscaling, as a deployment of its own had before.
The index application at `/` answers what spans models (/v2, /v2/health/*, /v1/models) and the
v1 predict route (`/v1/models/<name>:predict` cannot fall under a per-model prefix), calling the
model applications through their handles. docs/architecture.md says why this shape.

Everything tunable comes from `serve` (cluster/serve.yaml or the workload config).
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve

from app.config import NAME_PATTERN, ServeConfig, resolve_uri
from app.errors import UserError
from app.registry import Part, Task, task_of_schema
from app.runtime.artifact import resolve
from app.serve.replicas.apps import Index, model_app_name

MODEL_IMPORT_PATH = "app.serve.control.builders:build_model_app"
INDEX_IMPORT_PATH = "app.serve.control.builders:build_index_app"


class Server(Protocol):
    """A model replica's Serve class (app/serve/replicas/apps.py), built from an artifact and
    the serve section."""

    def __call__(self, artifact_uri: str, serve_config: dict[str, Any], /) -> Any: ...


SERVER = Part[Server]("server")


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    artifact: str


class ModelAppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelSpec
    serve: ServeConfig = Field(default_factory=ServeConfig)


class IndexAppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    models: list[str] = Field(default_factory=list)  # none: `GET /v1/models` lists none
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @field_validator("models")
    @classmethod
    def _unique(cls, models: list[str]) -> list[str]:
        if len(set(models)) != len(models):
            raise ValueError(f"model names must be unique, got {models}")
        return models


class RoutePrefix(Protocol):
    """The path a model's application takes, by its name: a task whose traffic is one route
    gives that route, so the proxy hands its requests straight to the model's replicas."""

    def __call__(self, model: str, /) -> str: ...


ROUTE_PREFIX = Part[RoutePrefix]("route_prefix")


def model_route(model: str, artifact: str | None = None) -> str:
    """`/v2/models/<name>`, or the prefix the artifact's task names (its ROUTE_PREFIX part)."""
    if artifact is not None:
        task = artifact_task(_pinned(artifact))
        if task.has(ROUTE_PREFIX):
            return task.part(ROUTE_PREFIX)(model)
    return f"/v2/models/{model}"


def _pinned(artifact: str) -> str:
    """The artifact's folder (a `latest` pointer followed); as given when it cannot be read
    (its replica refuses it properly)."""
    try:
        return resolve(resolve_uri(artifact))
    except (OSError, ValueError, UserError):
        return artifact


def artifact_task(artifact: str) -> Task:
    """The task an artifact's schema.json names (the replica verifies the whole artifact on load;
    an unreadable schema falls to the default task, whose replica then refuses it properly)."""
    import json

    from app import storage

    try:
        schema = json.loads(storage.read_bytes(storage.join(artifact, "schema.json")))
    except (OSError, ValueError):
        schema = {}
    return task_of_schema(schema if isinstance(schema, dict) else {})


def model_deployment(spec: ModelSpec, cfg: ServeConfig):
    a = cfg.autoscaling
    # Pin the concrete version: a replica started later must not pick up a newer `latest`.
    artifact = resolve(resolve_uri(spec.artifact))
    replica = artifact_task(artifact).part(SERVER)  # the task's replica class
    return (
        serve.deployment(replica)
        .options(  # type: ignore[attr-defined]
            name=f"model-{spec.name}",
            max_ongoing_requests=cfg.max_ongoing_requests,
            max_queued_requests=cfg.max_queued_requests,
            autoscaling_config={
                "min_replicas": a.min_replicas,
                "initial_replicas": max(a.min_replicas, 1),
                "max_replicas": a.max_replicas,
                "target_ongoing_requests": a.target_ongoing_requests,
                "upscale_delay_s": a.upscale_delay_s,
                "downscale_delay_s": a.downscale_delay_s,
                "metrics_interval_s": a.metrics_interval_s,
                "look_back_period_s": a.look_back_period_s,
            },
            ray_actor_options={"num_cpus": cfg.replica_cpus, "num_gpus": cfg.replica_gpus},
            user_config={"variant": cfg.variant},
            health_check_period_s=cfg.health_check_period_s,
            health_check_timeout_s=cfg.health_check_timeout_s,
            graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
            logging_config={"enable_access_log": cfg.access_log},
        )
        .bind(artifact, cfg.model_dump(mode="json"))
    )


def build_model_app(args: dict[str, Any]):
    parsed = ModelAppArgs.model_validate(args)
    return model_deployment(parsed.model, parsed.serve)


def build_index_app(args: dict[str, Any]):
    parsed = IndexAppArgs.model_validate(args)
    cfg = parsed.serve
    return (
        serve.deployment(Index)
        .options(  # type: ignore[attr-defined]
            name="index",
            num_replicas=cfg.ingress_replicas,
            max_ongoing_requests=cfg.ingress_max_ongoing_requests,
            max_queued_requests=cfg.max_queued_requests,
            ray_actor_options={"num_cpus": cfg.ingress_cpus},
        )
        .bind(cfg.model_dump(mode="json"), parsed.models)
    )


def applications(models: list[dict[str, str]], serve_config: dict[str, Any]) -> list[dict]:
    """The Serve deploy-config `applications` for these models: one each, plus the index.
    jobs.deploy writes this shape; cluster/serve.yaml and the RayService carry it."""
    cfg = ServeConfig.model_validate(serve_config)
    specs = sorted((ModelSpec.model_validate(m) for m in models), key=lambda m: m.name)
    dumped = cfg.model_dump(mode="json")
    apps = [
        {
            "name": model_app_name(cfg, m.name),
            "route_prefix": model_route(m.name, m.artifact),
            "import_path": MODEL_IMPORT_PATH,
            "args": {"model": m.model_dump(), "serve": dumped},
        }
        for m in specs
    ]
    apps.append(
        {
            "name": cfg.app_name,
            "route_prefix": "/",
            "import_path": INDEX_IMPORT_PATH,
            "args": {"models": [m.name for m in specs], "serve": dumped},
        }
    )
    return apps


def run_local(models: list[dict[str, str]], serve_config: dict[str, Any]) -> None:
    """serve.run every application of `applications` (tests and benchmarks; Serve running)."""
    builders = {MODEL_IMPORT_PATH: build_model_app, INDEX_IMPORT_PATH: build_index_app}
    for app in applications(models, serve_config):
        serve.run(
            builders[app["import_path"]](app["args"]),
            name=app["name"],
            route_prefix=app["route_prefix"],
        )
