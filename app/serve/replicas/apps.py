"""The Serve deployment classes: a model's replica answering its own routes (`SelfServing` mixed
into a task's replica class, app/tasks/<task>/replica.py: its HTTP stack and its model in one
process), and the `Index` answering the routes that span models through the model
applications' handles. Which class a model gets is its task's `server` part;
app/serve/control/builders.py deploys them."""

from __future__ import annotations

from typing import Any

from ray import serve

from app.config import ServeConfig
from app.ray_private import serve_http_host
from app.registry import task_of_schema
from app.serve.http.api import create_api
from app.serve.http.clients import LocalModel, ModelClient, Models, RayModel
from app.serve.http.gate import IngressMetrics


def model_app_name(cfg: ServeConfig, model: str) -> str:
    return f"{cfg.app_name}-{model}"


class SelfServing:
    """Mixed into a replica class: the replica answers its own model's routes (its HTTP stack
    and its model in one process, no hop between them)."""

    artifact: Any  # an Artifact, or a VectorIndex (its name is the route's)

    def __init__(self, artifact_uri: str, serve_config: dict[str, Any]):
        self.config = ServeConfig.model_validate(serve_config)
        super().__init__(artifact_uri, self.config)  # type: ignore[call-arg]

    async def __serve_build_asgi_app__(self):
        # The API key rule needs the host Serve really listens on (cluster/serve.yaml and the
        # RayService set it in http_options, not in these args): ask the controller.
        host = await serve_http_host()
        own_task_routes(self.artifact.schema)
        models = Models.configured({self.artifact.name: LocalModel(self)}, self.config)
        return create_api(self.config, models, IngressMetrics(), serve_host=host, under_serve=True)


def own_task_routes(schema: dict[str, Any]) -> None:
    """A model of a task from outside app/ ("pkg.module:TASK" in its schema): that task looked
    up, so its routes are known here. A built-in task's are anyway, without loading any spec."""
    task = str(schema.get("task", ""))
    if ":" in task:
        task_of_schema(schema)


@serve.ingress()
class Index:
    """Routes across models; reaches each model's application through its handle."""

    def __init__(self, serve_config: dict[str, Any], models: list[str]):
        self.config = ServeConfig.model_validate(serve_config)
        clients: dict[str, ModelClient] = {
            m: RayModel(model_app_name(self.config, m)) for m in models
        }
        self.models = Models.configured(clients, self.config)

    async def __serve_build_asgi_app__(self):
        host = await serve_http_host()
        return create_api(
            self.config, self.models, IngressMetrics(), serve_host=host, under_serve=True
        )
