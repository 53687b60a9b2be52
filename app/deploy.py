"""Deploy: add or replace one model in the cluster's single Serve application.

The application is managed declaratively, the same way `serve deploy cluster/serve.yaml` does
(so the two never fight): the job reads the running config, puts this model's artifact in its
`models` list and submits it. Serve then rolls only what changed: a new version of one model is a
rolling update of that model's replicas, with no failed requests; deploying an older version is a
rollback. The job returns once the model answers with the new version over HTTP.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import requests

from app.artifact import open_artifact
from app.cli import UserError, connect_ray
from app.config import Config, resolve_uri
from app.serve.ingress import api_key, is_loopback

log = logging.getLogger(__name__)
IMPORT_PATH = "app.serve.app:build_app"


def deploy(config: Config, artifact_uri: str, timeout_s: float = 300.0) -> dict[str, Any]:
    artifact = open_artifact(resolve_uri(artifact_uri))  # verify before touching the cluster
    cfg = config.serve
    if not is_loopback(cfg.host):
        api_key(cfg)  # refuses a public bind without a key
    connect_ray(require_cluster=True)
    client = serve_client()
    details = client.get_serve_details()
    apps = current_apps(details)
    app = apps.get(cfg.app_name) or {
        "name": cfg.app_name,
        "route_prefix": "/",
        "import_path": IMPORT_PATH,
        "args": {"models": []},
    }
    models = [m for m in app["args"].get("models", []) if m["name"] != artifact.name]
    models.append({"name": artifact.name, "artifact": artifact.uri})
    app["args"] = {
        "models": sorted(models, key=lambda m: m["name"]),
        "serve": cfg.model_dump(mode="json"),
    }
    apps[cfg.app_name] = app
    log.info(
        "deploy: %s version %s -> application %r", artifact.name, artifact.version, cfg.app_name
    )
    client.deploy_applications(
        {
            "http_options": {"host": cfg.host, "port": cfg.port},
            "applications": list(apps.values()),
        }
    )
    url = f"http://{'127.0.0.1' if cfg.host in ('0.0.0.0', '::') else cfg.host}:{cfg.port}"
    deadline = time.monotonic() + timeout_s
    wait_until_rolled_out(client, cfg.app_name, artifact.name, deadline)
    wait_until_serving(url, artifact.name, artifact.version, cfg.api_key_env, deadline)
    return {
        "stage": "deploy",
        "url": url,
        "model": artifact.name,
        "version": artifact.version,
        "artifact": artifact.uri,
        "models": [m["name"] for m in app["args"]["models"]],
    }


def serve_client():
    import ray
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    dashboard = ray._private.worker.get_dashboard_url()
    if not dashboard:
        raise UserError(
            "the Ray dashboard is not running; the Serve REST API needs it (start the cluster with cluster/start.sh)"
        )
    return ServeSubmissionClient(f"http://{dashboard}")


def current_apps(details: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The deployed configs of every application, so that redeploying keeps the others."""
    apps = {}
    for name, app in (details.get("applications") or {}).items():
        deployed = app.get("deployed_app_config")
        if deployed:
            apps[name] = {k: v for k, v in deployed.items() if v is not None}
    return apps


def wait_until_rolled_out(client, app_name: str, model: str, deadline: float) -> None:
    """Until the application is RUNNING and the model's deployment HEALTHY (no old replicas left)."""
    time.sleep(1.0)  # let the controller take the new config before reading its status
    last = "unknown"
    while time.monotonic() < deadline:
        app = (client.get_serve_details().get("applications") or {}).get(app_name) or {}
        deployment = (app.get("deployments") or {}).get(f"model-{model}") or {}
        last = f"application {app.get('status')}, model-{model} {deployment.get('status')}"
        if app.get("status") == "DEPLOY_FAILED":
            raise UserError(f"deploy failed: {app.get('message', '')[:500]}")
        if app.get("status") == "RUNNING" and deployment.get("status") == "HEALTHY":
            return
        time.sleep(1.0)
    raise UserError(f"rollout of {model} did not finish in time ({last}); see `serve status`")


def wait_until_serving(
    url: str, model: str, version: str, api_key_env: str, deadline: float
) -> None:
    import os

    headers = {}
    if os.environ.get(api_key_env):
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            r = requests.get(f"{url}/v2/models/{model}", headers=headers, timeout=5)
            if r.status_code == 200 and r.json().get("versions") == [version]:
                log.info("deploy: %s version %s is serving at %s", model, version, url)
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except requests.RequestException as e:
            last = type(e).__name__
        time.sleep(1.0)
    raise UserError(
        f"model {model} version {version} did not come up in time ({last}); see `serve status`"
    )
