"""Model lifecycle on a registry: list versions, take a model off Serve, prune old versions.

The registry (`<export.registry>/<name>/<version>/`, with `<name>/latest` pointing at the newest
good version) is the source of truth for what exists; the running Serve application for what is
live. Without a cluster nothing is live, which `list` reports as "unknown" (a registry on shared
storage may still be served by a cluster this machine cannot see).

Pruning covers a model's versions and its vector index's (`<name>/index/<version>`), keeping the
newest N of each. It never deletes the version `latest` points at, nor one a running cluster
serves or pins, nor an encoder version any remaining index embeds its queries with, nor a
version without its manifest (an export still writing it: the manifest is written last); it asks
the cluster under the deploy lock, and without a cluster it refuses unless forced.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from app import storage
from app.config import NAME_PATTERN, Config
from app.runtime import artifact as art

log = logging.getLogger(__name__)
UNKNOWN = "unknown"
INDEX_FOLDER = "index"  # <registry>/<model>/index/<version>: the model's vector indexes
INDEX_FIGURES = ("vectors", "dim", "method", "index_bytes", "recall_at_10", "build_seconds")


def list_models(config: Config) -> dict[str, Any]:
    live = live_versions(config)
    models = [model_entry(config.registry, name, live) for name in model_names(config.registry)]
    return {"stage": "models", "action": "list", "registry": config.registry, "models": models}


def model_names(registry: str) -> list[str]:
    if not storage.exists(registry):
        return []
    return sorted(
        n
        for n in storage.list_dir(registry)
        if storage.exists(storage.join(registry, n, art.LATEST))
    )


def model_entry(registry: str, name: str, live: dict[str, str] | None) -> dict[str, Any]:
    """A model's versions (latest, live, gate figures) and its vector indexes' versions
    (`<name>/index/`: encoder, vectors, bytes, held-out recall), oldest first."""
    folder = storage.join(registry, name)
    latest = str(storage.read_int(storage.join(folder, art.LATEST)))
    serving = UNKNOWN if live is None else live.get(name)
    versions = []
    for version in complete_versions(folder):
        versions.append(
            {
                "version": version,
                "latest": version == latest,
                "live": UNKNOWN if live is None else version == serving,
                **version_facts(storage.join(folder, version)),
            }
        )
    entry = {"name": name, "latest": latest, "live": serving, "versions": versions}
    return entry | {"indexes": index_entries(storage.join(folder, INDEX_FOLDER), live)}


def index_entries(folder: str, live: dict[str, str] | None) -> list[dict[str, Any]]:
    """Every complete version of a model's vector index, as `list` shows it."""
    if not storage.exists(storage.join(folder, art.LATEST)):
        return []
    latest = str(storage.read_int(storage.join(folder, art.LATEST)))
    out = []
    for version in complete_versions(folder):
        uri = storage.join(folder, version)
        manifest = art.read_manifest(uri)
        report = _json(storage.join(uri, "report.json"))
        out.append(
            {
                "version": version,
                "name": manifest.name,
                "latest": version == latest,
                "live": UNKNOWN if live is None else live.get(manifest.name) == version,
                "created": manifest.created,
                "encoder": index_encoder(uri),
                **{k: report.get(k) for k in INDEX_FIGURES},
            }
        )
    return out


def _json(path: str) -> dict[str, Any]:
    from app.errors import ArtifactError

    try:
        return json.loads(storage.read_bytes(path))
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path}: unreadable ({str(e).splitlines()[0][:120]})") from None


def complete_versions(folder: str) -> list[str]:
    """Versions with their manifest (written last, so complete), oldest first."""
    return [
        str(v)
        for v in art.versions(folder)
        if storage.exists(storage.join(folder, str(v), art.MANIFEST))
    ]


def version_facts(uri: str) -> dict[str, Any]:
    """When it was made, from what, and its gate report in brief (the whole one is report.json)."""
    manifest = art.read_manifest(uri)
    report = _json(storage.join(uri, "report.json"))
    return {
        "created": manifest.created,
        "source_checkpoint": manifest.source_checkpoint,
        "base_model": manifest.base_model,
        "gate": gate_figures(report),
    }


def gate_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The gate's headline figures: accuracy for a classifier, perplexity and greedy agreement
    for a language model, R@1 both ways and the cosine with torch for a retrieval model
    (report.json has the rest)."""
    common = {
        "size_ratio_int8": report.get("size_ratio_int8"),
        "thresholds": report.get("thresholds", {}),
    }
    if "recall_drop" in report:
        recall = report.get("recall", {})
        return {
            variant: {k: recall.get(variant, {}).get(k) for k in ("i2t_r1", "t2i_r1", "rsum")}
            for variant in ("fp32", "int8")
        } | {
            "recall_drop_points": report["recall_drop"],
            "min_cosine": (report.get("parity") or {}).get("min_cosine"),
            **common,
        }
    if "perplexity" in report:
        return {
            "perplexity": report["perplexity"],
            "perplexity_increase": report.get("perplexity_increase"),
            "greedy_agreement": (report.get("greedy") or {}).get("token_agreement"),
            **common,
        }
    accuracy = report.get("accuracy", {})
    return {
        "fp32_accuracy": accuracy.get("onnx_fp32"),
        "int8_accuracy": accuracy.get("onnx_int8"),
        "accuracy_drop_points": report.get("accuracy_drop_points"),
        **common,
    }


# --- what a running cluster serves -------------------------------------------------------------


def live_versions(config: Config) -> dict[str, str] | None:
    """{model name: version served} for this project's Serve applications; None when no cluster
    runs (nothing can be known to be live)."""
    live = live_folders(config)
    return None if live is None else {name: version for name, (_, version) in live.items()}


def live_folders(config: Config) -> dict[str, tuple[str, str]] | None:
    """{name: (its version folder, the version)} of every model and index served; None when no
    cluster runs."""
    from app.config import resolve_uri
    from app.errors import NoClusterError
    from app.ray_runtime import connect_ray
    from app.serve.control.deploy import current_apps, serve_client, served_models, serving_address

    try:
        connect_ray(require_cluster=True)
    except NoClusterError:
        return None
    details = serve_client().get_serve_details()
    host, port = serving_address(details, config.serve)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    live = {}
    for name, uri in served_models(current_apps(details), config.serve).items():
        uri = resolve_uri(uri).rstrip("/")
        version = served_version(uri, url, name, config.serve.api_key_env)
        folder = storage.join(uri.rsplit("/", 1)[0], version) if uri.endswith(art.LATEST) else uri
        live[name] = (folder, version)
    return live


def served_version(uri: str, url: str, name: str, api_key_env: str) -> str:
    """The version a model's replicas run: the folder its application names, or, when that is a
    `latest` pointer (cluster/serve.yaml), what the model answers over HTTP (its replicas pinned
    whatever `latest` was when they started, which need not be what it is now)."""
    from app.serve.control.deploy import serving_version

    if uri.rstrip("/").rsplit("/", 1)[-1] != art.LATEST:
        return uri.rstrip("/").rsplit("/", 1)[-1]
    return serving_version(url, name, api_key_env)


def undeploy(config: Config, names: list[str], timeout_s: float = 120.0) -> dict[str, Any]:
    """Take these models' Serve applications away, in one config update; the other models'
    applications do not change, so Serve leaves their replicas alone (the index is updated to
    list the rest)."""
    from app.errors import UserError
    from app.ray_runtime import connect_ray
    from app.serve.control.deploy import (
        ROLLBACK_TIMEOUT_S,
        current_apps,
        serve_client,
        serve_config,
        served_models,
        wait_for_app,
        without_model,
    )
    from app.serve.control.deploy_lock import cluster_lock
    from app.serve.replicas.apps import model_app_name

    connect_ray(require_cluster=True)
    cfg = config.serve
    with cluster_lock(ttl_s=timeout_s + ROLLBACK_TIMEOUT_S, wait_s=timeout_s):
        client = serve_client()
        apps = current_apps(client.get_serve_details())
        served = served_models(apps, cfg)
        missing = [n for n in names if n not in served]
        if missing:
            listing = ", ".join(sorted(served)) or "none"
            raise UserError(f"{missing[0]} is not deployed (serving: {listing})")
        for name in names:
            apps = without_model(apps, cfg, name)
        client.deploy_applications(serve_config(cfg, apps))
        deadline = time.monotonic() + timeout_s
        for name in names:
            state = wait_for_app(client, model_app_name(cfg, name), False, deadline)
            if state != "absent":
                raise UserError(f"{name}: its application is still {state} after {timeout_s:g}s")
    log.info("undeploy: %s removed", ", ".join(names))
    remaining = sorted(n for n in served if n not in names)
    return {"stage": "models", "action": "undeploy", "undeployed": names, "models": remaining}


# --- pruning ------------------------------------------------------------------------------------


def prune(
    config: Config, keep: int, model: str | None = None, force: bool = False
) -> dict[str, Any]:
    """Delete all but the newest `keep` complete versions of each model (or of `model`). The
    latest version stays, and so does every version a running application serves or its deploy
    config pins, read under the deploy lock so that no deploy changes them meanwhile. Without a
    reachable cluster nothing can be known to be unused: refused unless `force`."""
    from app.errors import ConfigError, NoClusterError

    if keep < 1:
        raise ConfigError(f"--keep must be at least 1 (got {keep})")
    if model is not None and not re.match(NAME_PATTERN, model):
        raise ConfigError(f"--model {model!r}: not a model name (letters, digits, _.- only)")
    names = [model] if model else model_names(config.registry)
    if not force:
        try:
            return _prune_under_lock(config, keep, names)
        except NoClusterError as e:
            raise NoClusterError(
                f"prune: {e}; without a cluster nothing tells which versions are served "
                "(a replica restart would fail on a deleted one): start it, or pass --force"
            ) from None
    deleted = {name: prune_model(config.registry, name, keep, set()) for name in names}
    return {"stage": "models", "action": "prune", "keep": keep, "deleted": deleted}


def _prune_under_lock(config: Config, keep: int, names: list[str]) -> dict[str, Any]:
    from app.ray_runtime import connect_ray
    from app.serve.control.deploy import ROLLBACK_TIMEOUT_S
    from app.serve.control.deploy_lock import cluster_lock

    connect_ray(require_cluster=True)
    with cluster_lock(ttl_s=ROLLBACK_TIMEOUT_S, wait_s=ROLLBACK_TIMEOUT_S):
        in_use = versions_in_use(config)
        deleted = {
            name: prune_model(config.registry, name, keep, in_use.get(name, set()), in_use)
            for name in names
        }
    return {"stage": "models", "action": "prune", "keep": keep, "deleted": deleted}


def versions_in_use(config: Config) -> dict[str, set[str]]:
    """Per model, the version the running Serve config pins (its artifact folder), or, for a
    `latest` pointer, the one its replicas answer with (what `latest` was when they started);
    and the encoder version every served vector index embeds its queries with."""
    in_use: dict[str, set[str]] = {}
    for name, (folder, version) in (live_folders(config) or {}).items():
        in_use.setdefault(name, set()).add(version)
        encoder = index_encoder(folder)
        if encoder is not None:
            in_use.setdefault(encoder["name"], set()).add(str(encoder["version"]))
    return in_use


def index_encoder(folder: str) -> dict[str, str] | None:
    """The encoder a vector index version names (None for a model, or an unreadable schema)."""
    from app.runtime.vector_index import INDEX_TASK

    try:
        schema = json.loads(storage.read_bytes(storage.join(folder, "schema.json")))
    except (OSError, ValueError):
        return None
    return schema.get("encoder") if schema.get("task") == INDEX_TASK else None


def indexes_encoders(folder: str, name: str) -> set[str]:
    """The versions of `name` its vector indexes (every complete one under `<name>/index/`)
    were built with: deploying any of them needs its encoder, with or without a cluster."""
    index = storage.join(folder, INDEX_FOLDER)
    if not storage.exists(index):
        return set()
    encoders = (index_encoder(storage.join(index, v)) for v in complete_versions(index))
    return {str(e["version"]) for e in encoders if e and e["name"] == name}


def prune_model(
    registry: str,
    name: str,
    keep: int,
    in_use: set[str],
    served: dict[str, set[str]] | None = None,
) -> list[str]:
    """Delete `name`'s old versions and its index's (`index/<v>` in the list returned), keeping
    the newest `keep` of each, the latest, those in use (`in_use`; an index's by its served
    name in `served`) and every encoder version a remaining index needs."""
    from app.errors import UserError

    folder = storage.join(registry, name)
    if not storage.exists(storage.join(folder, art.LATEST)):
        raise UserError(f"{folder}: no such model in the registry")
    index = storage.join(folder, INDEX_FOLDER)
    doomed_indexes: list[str] = []
    if storage.exists(storage.join(index, art.LATEST)):
        index_name = art.read_manifest(storage.join(index, complete_versions(index)[-1])).name
        index_in_use = (served or {}).get(index_name, set())
        doomed_indexes = _prune_versions(index, f"{name}/{INDEX_FOLDER}", keep, index_in_use)
    doomed = _prune_versions(folder, name, keep, in_use | indexes_encoders(folder, name))
    return doomed + [f"{INDEX_FOLDER}/{v}" for v in doomed_indexes]


def _prune_versions(folder: str, what: str, keep: int, in_use: set[str]) -> list[str]:
    from app.errors import UserError

    unknown = sorted(v for v in in_use if not v.isdigit())
    if unknown:
        raise UserError(f"{what}: cannot tell which version is live ({unknown[0]}); nothing pruned")
    latest = str(storage.read_int(storage.join(folder, art.LATEST)))
    versions = complete_versions(folder)
    protected = set(versions[-keep:]) | {latest} | in_use
    doomed = [v for v in versions if v not in protected]
    for version in doomed:
        # The manifest goes first: a reader then sees an incomplete version, never a
        # half-deleted one that still claims to be whole.
        storage.delete_file(storage.join(folder, version, art.MANIFEST))
        storage.delete_dir(storage.join(folder, version))
        log.info("prune: deleted %s/%s", what, version)
    return doomed
