"""The Serve application builder: `import_path: app.serve.app:build_app` with typed args.

    args:
      models: [{name: digits, artifact: <artifact folder or <registry>/<name>/latest>}, ...]
      serve: {...ServeConfig: variant, batching, autoscaling, queue bounds, resources...}

One application holds every live model: an ingress deployment plus one `model-<name>`
deployment per model. Everything tunable comes from `serve` (cluster/serve.yaml or the workload
config), nothing is fixed in code.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve

from app.artifact import resolve
from app.config import ServeConfig, resolve_uri
from app.serve.ingress import IngressMetrics, ModelRouter, create_api, serve_http_host
from app.serve.model_server import ModelServer


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    artifact: str


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    models: list[ModelSpec] = Field(min_length=1)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @field_validator("models")
    @classmethod
    def _unique(cls, models: list[ModelSpec]) -> list[ModelSpec]:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        return models


@serve.ingress()
class Ingress:
    def __init__(self, serve_config: dict[str, Any], models: dict[str, Any]):
        self.config = ServeConfig.model_validate(serve_config)
        self.router = ModelRouter(models, self.config.request_timeout_s)

    async def __serve_build_asgi_app__(self):
        # The API key rule needs the host Serve really listens on (cluster/serve.yaml and the
        # RayService set it in http_options, not in these args): ask the controller.
        host = await serve_http_host()
        return create_api(self.config, self.router, IngressMetrics(), serve_host=host)


def model_deployment(spec: ModelSpec, cfg: ServeConfig):
    a = cfg.autoscaling
    # Pin the concrete version: a replica started later must not pick up a newer `latest`.
    artifact = resolve(resolve_uri(spec.artifact))
    return (
        serve.deployment(ModelServer)
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
        )
        .bind(
            artifact,
            cfg.max_batch_size,
            cfg.batch_wait_timeout_s,
            max(1, math.floor(cfg.replica_cpus)),
            cfg.max_request_rows,
        )
    )


def build_app(args: dict[str, Any]):
    parsed = AppArgs.model_validate(args)
    cfg = parsed.serve
    models = {spec.name: model_deployment(spec, cfg) for spec in parsed.models}
    return (
        serve.deployment(Ingress)
        .options(  # type: ignore[attr-defined]
            name="ingress",
            num_replicas=cfg.ingress_replicas,
            max_ongoing_requests=cfg.ingress_max_ongoing_requests,
            ray_actor_options={"num_cpus": cfg.ingress_cpus},
        )
        .bind(cfg.model_dump(mode="json"), models)
    )
