"""Deploy: add or replace one model's Serve application (and the index that lists the models).

The applications are managed declaratively, the same way `serve deploy cluster/serve.yaml` does
(so the two never fight): the job reads the running config, sets this model's application
(app.serve.control.builders.applications: one per model, plus the index at `/`) and submits the whole config.
Serve then rolls only what changed: a new version of one model is a rolling update of that model's
application, with no failed requests; deploying an older version is a rollback. The job returns
once the model answers with the new version over HTTP.

Two deploys at once would each submit a config without the other's model, so the whole
read-modify-write, the rollout check and any rollback run under the cluster's deploy lock
(app.serve.control.deploy_lock). A version that does not come up (its application or deployment fails,
or it does not answer in time) is rolled back: the previous config is submitted again, so the
previous version keeps serving, and the job fails with one line saying so.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import requests

from app.config import Config, ServeConfig, resolve_uri
from app.errors import UserError
from app.ray_runtime import connect_ray
from app.runtime.artifact import open_verified
from app.serve.control.builders import MODEL_IMPORT_PATH, applications
from app.serve.control.deploy_lock import cluster_lock
from app.serve.http.gate import api_key
from app.serve.replicas.apps import model_app_name

log = logging.getLogger(__name__)
POLL_S = 1.0
ROLLBACK_TIMEOUT_S = 120.0


def deploy(config: Config, artifact_uri: str, timeout_s: float = 300.0) -> dict[str, Any]:
    # Verified before touching the cluster (a model or a vector index: its replica loads it).
    uri, manifest, _ = open_verified(resolve_uri(artifact_uri))
    cfg = config.serve
    require_key(cfg, None)  # a public serve.host without a key: refuse before any work
    connect_ray(require_cluster=True)
    model = {"name": manifest.name, "artifact": uri}
    # The lease outlives the longest locked section (rollout, then rollback) with room to spare.
    with cluster_lock(ttl_s=timeout_s + ROLLBACK_TIMEOUT_S + 60, wait_s=timeout_s):
        url, app = apply(serve_client(), cfg, model, str(manifest.version), timeout_s)
    return {
        "stage": "deploy",
        "url": url,
        "model": manifest.name,
        "version": str(manifest.version),
        "artifact": uri,
        "models": app["args"]["models"],
    }


def apply(
    client, cfg: ServeConfig, model: dict[str, str], version: str, timeout_s: float
) -> tuple[str, dict[str, Any]]:
    """Read-modify-write of the Serve config (call it under the deploy lock), then check the new
    version comes up; roll back to the config read here if it does not. Returns the URL and the
    index application (its args list the served models)."""
    details = client.get_serve_details()
    host, port = serving_address(details, cfg)
    require_key(cfg, host)
    before = current_apps(details)
    after = with_model(before, cfg, model)
    app_name = model_app_name(cfg, model["name"])
    log.info("deploy: %s version %s -> application %r", model["name"], version, app_name)
    client.deploy_applications(serve_config(cfg, after))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    try:
        wait_until_up(client, url, cfg, model["name"], version, time.monotonic() + timeout_s)
    except UserError as e:
        raise rollback(client, cfg, before, model["name"], str(e)) from None
    return url, after[cfg.app_name]


def require_key(cfg: ServeConfig, serve_host: str | None) -> None:
    """app.serve.http.gate.api_key's rule, as a one-line UserError (the ingress would refuse to
    start anyway; this says so before anything is submitted)."""
    try:
        api_key(cfg, serve_host)
    except RuntimeError as e:
        raise UserError(str(e)) from None


def serving_address(details: dict[str, Any], cfg: ServeConfig) -> tuple[str, int]:
    """Where Serve really listens: a running Serve keeps the http_options it started with and
    ignores a deploy's; before Serve starts, this deploy's serve.host and port will be used."""
    http = details.get("http_options") or {}
    return str(http.get("host") or cfg.host), int(http.get("port") or cfg.port)


def served_models(apps: dict[str, dict[str, Any]], cfg: ServeConfig) -> dict[str, str]:
    """name -> artifact of every model this project's applications serve."""
    models: dict[str, str] = {}
    for name, app in apps.items():
        args = app.get("args") or {}
        if is_model_app(name, app, cfg):
            models[args["model"]["name"]] = args["model"]["artifact"]
    return models


def with_model(
    apps: dict[str, dict[str, Any]], cfg: ServeConfig, model: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """A copy of `apps` with `model`'s application built from this `serve` config and the index
    listing every model. Every other application stays exactly as it is, so Serve leaves its
    replicas (and their own serve settings and pinned artifact) alone."""
    models = {**served_models(apps, cfg), model["name"]: model["artifact"]}
    return rebuilt(apps, cfg, models, changed=model["name"])


def without_model(
    apps: dict[str, dict[str, Any]], cfg: ServeConfig, name: str
) -> dict[str, dict[str, Any]]:
    """A copy of `apps` without `name`'s application (the index then lists the others; with no
    model left it stays, so that `GET /v1/models` answers an empty list). The other models'
    applications are unchanged, so Serve leaves their replicas alone."""
    models = {n: a for n, a in served_models(apps, cfg).items() if n != name}
    return rebuilt(apps, cfg, models, changed=None)


def rebuilt(
    apps: dict[str, dict[str, Any]], cfg: ServeConfig, models: dict[str, str], changed: str | None
) -> dict[str, dict[str, Any]]:
    """Applications not ours as they are; ours for exactly `models`: the `changed` one (and any
    still in the one-application shape) built anew, the others' kept; the index rebuilt."""
    ours = {cfg.app_name} | {n for n, a in apps.items() if is_model_app(n, a, cfg)}
    result = {n: copy.deepcopy(a) for n, a in apps.items() if n not in ours}
    specs = [{"name": n, "artifact": a} for n, a in models.items()]
    for app in applications(specs, cfg.model_dump(mode="json")):
        name = app["name"]
        model = (app["args"].get("model") or {}).get("name")
        keep = model is not None and model != changed and is_model_app(name, apps.get(name), cfg)
        result[name] = copy.deepcopy(apps[name]) if keep else app
    return result


def is_model_app(name: str, app: dict[str, Any] | None, cfg: ServeConfig) -> bool:
    return (
        app is not None
        and app.get("import_path") == MODEL_IMPORT_PATH
        and name.startswith(f"{cfg.app_name}-")
    )


def serve_config(cfg: ServeConfig, apps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    # Serve's deploy-config default host is 0.0.0.0 (public): always name it.
    return {
        "http_options": {"host": cfg.host, "port": cfg.port},
        "applications": list(apps.values()),
    }


def rollback(
    client, cfg: ServeConfig, before: dict[str, dict[str, Any]], model: str, reason: str
) -> UserError:
    """Submit the previous config again and say what now serves; the returned error is the
    job's one-line failure."""
    log.error("deploy: %s did not come up (%s); rolling back", model, reason)
    try:
        client.deploy_applications(serve_config(cfg, before))
    except Exception as e:  # noqa: BLE001 - the job still ends with one line saying both
        return UserError(
            f"deploy of {model} failed: {one_line(reason)}; rollback failed: {one_line(str(e))}"
        )
    artifact = served_models(before, cfg).get(model)
    restored = f"{model} from {artifact}" if artifact else f"no {model} (it was new)"
    deadline = time.monotonic() + ROLLBACK_TIMEOUT_S
    app_name = model_app_name(cfg, model)
    if app_name not in before and cfg.app_name in before:
        app_name = cfg.app_name  # a model that was new: the index shows the rollback
    state = wait_for_app(client, app_name, app_name in before, deadline)
    return UserError(
        f"deploy of {model} failed: {one_line(reason)}; rolled back to the previous config "
        f"({restored}; application {state}); see `serve status`"
    )


def one_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else "no reason given")[:limit]


def wait_for_app(client, app_name: str, should_exist: bool, deadline: float) -> str:
    """Until the application is RUNNING again (or gone, when the previous config had none)."""
    status = "unknown"
    time.sleep(POLL_S)  # the status read right after a submit can still be the failed one's
    while time.monotonic() < deadline:
        app = (client.get_serve_details().get("applications") or {}).get(app_name)
        status = (app or {}).get("status", "absent")
        if status == ("RUNNING" if should_exist else "absent"):
            break
        time.sleep(POLL_S)
    return status


def serve_client():
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    from app.ray_private import dashboard_url

    dashboard = dashboard_url()
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


def wait_until_up(
    client, url: str, cfg: ServeConfig, model: str, version: str, deadline: float
) -> None:
    """Until the application is RUNNING, the model's deployment HEALTHY (no old replicas left)
    and the model answers over HTTP with `version`; UserError as soon as Serve reports a failed
    deploy, or at the deadline."""
    time.sleep(POLL_S)  # let the controller take the new config before reading its status
    last = "unknown"
    while time.monotonic() < deadline:
        apps = client.get_serve_details().get("applications") or {}
        app = apps.get(model_app_name(cfg, model)) or {}
        index = apps.get(cfg.app_name) or {}
        deployment = (app.get("deployments") or {}).get(f"model-{model}") or {}
        last = (
            f"application {app.get('status')}, model-{model} {deployment.get('status')}, "
            f"index {index.get('status')}"
        )
        if "DEPLOY_FAILED" in (app.get("status"), deployment.get("status"), index.get("status")):
            message = deployment.get("message") or app.get("message") or index.get("message")
            raise UserError(f"{last}: {one_line(message or '')}")
        running = app.get("status") == index.get("status") == "RUNNING"
        if running and deployment.get("status") == "HEALTHY":
            answer = serving_version(url, model, cfg.api_key_env)
            if answer == version:
                log.info("deploy: %s version %s is serving at %s", model, version, url)
                return
            last = f"{last}, HTTP answer: {answer}"
        time.sleep(POLL_S)
    raise UserError(f"{model} version {version} did not come up in time ({last})")


def serving_version(url: str, model: str, api_key_env: str) -> str:
    """The version the model answers with over HTTP, or what went wrong."""
    headers = {}
    if os.environ.get(api_key_env):
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    try:
        r = requests.get(f"{url}/v2/models/{model}", headers=headers, timeout=5)
    except requests.RequestException as e:
        return type(e).__name__
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    versions = r.json().get("versions") or ["?"]
    return str(versions[0])
