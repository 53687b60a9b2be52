"""The files under cluster/ are well formed and agree with each other and with the project.

- every YAML / JSON file parses;
- the KubeRay manifests validate against the v1 schemas of the KubeRay CRDs (and use no field the
  CRDs do not know, which the API server would silently prune);
- cluster/serve.yaml is a valid Serve deploy config whose `serve` args are a valid ServeConfig, and
  the RayService carries the same application (only the artifact URIs differ);
- one Ray version everywhere: pyproject's pin, the Dockerfile, the launcher and every manifest;
- the cluster scripts are strict bash.

Pure file checks: no Ray, no subprocess. The scripts themselves run in
tests/integration/test_cluster_scripts.py.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from app.config import ServeConfig

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
KUBERAY = CLUSTER / "kuberay"
CRD_VERSION = "v1.7.0"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
MANIFESTS = {
    "raycluster.yaml": "RayCluster",
    "rayjob.yaml": "RayJob",
    "rayservice.yaml": "RayService",
}
REQUIRED_FILES = [
    "start.sh",
    "stop.sh",
    "runtime_env.yaml",
    "serve.yaml",
    "Dockerfile",
    "kuberay/raycluster.yaml",
    "kuberay/rayjob.yaml",
    "kuberay/rayservice.yaml",
    "launcher/aws-gpu.yaml",
    "monitoring/prometheus.yml",
    "monitoring/grafana-dashboard.json",
]


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB each


def _load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_Loader)  # a safe loader


def _crd_dir() -> Path:
    """The KubeRay CRDs: $KUBERAY_CRDS, else a `shared/kuberay-crds` folder beside the repo.

    The CRD schemas are not vendored (1 MB each, KubeRay's files): a clone without them skips the
    schema checks and says how to run them; every other manifest check still runs.
    """
    candidates = []
    if os.environ.get("KUBERAY_CRDS"):
        candidates.append(Path(os.environ["KUBERAY_CRDS"]))
    candidates.append(REPO.parent / "shared" / "kuberay-crds")
    for base in candidates:
        for folder in (base / CRD_VERSION, base):
            if all((folder / name).is_file() for name in CRD_FILES.values()):
                return folder
    pytest.skip(
        f"KubeRay {CRD_VERSION} CRDs not found (looked in {', '.join(map(str, candidates))}): "
        "set KUBERAY_CRDS to a folder holding ray.io_rayclusters.yaml, ray.io_rayjobs.yaml and "
        "ray.io_rayservices.yaml (ray-operator/config/crd/bases/ of the KubeRay release) to run them"
    )


def _crd_schema(kind: str) -> dict[str, Any]:
    return copy.deepcopy(_cached_crd_schema(kind))


@functools.cache
def _cached_crd_schema(kind: str) -> dict[str, Any]:
    crd = _load_yaml(_crd_dir() / CRD_FILES[kind])
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def _unknown_fields(node: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths of keys the structural schema does not declare (Kubernetes would prune them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(node, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in node.items():
            where = f"{path}.{key}" if path else key
            if props is not None and key in props:
                found += _unknown_fields(value, props[key], where)
            elif isinstance(extra, dict):
                found += _unknown_fields(value, extra, where)
            elif props is not None and extra is not True:
                found.append(where)
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(node):
            found += _unknown_fields(value, schema["items"], f"{path}[{i}]")
    return found


def _walk(node: Any, key: str) -> list[Any]:
    """Every value stored under `key` anywhere in a nested structure."""
    out: list[Any] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                out.append(v)
            out += _walk(v, key)
    elif isinstance(node, list):
        for v in node:
            out += _walk(v, key)
    return out


def _pinned_ray_version() -> str:
    text = (REPO / "pyproject.toml").read_text()
    pins = re.findall(r'"ray(?:\[[^\]]*\])?==([0-9][0-9A-Za-z.]*)"', text)
    assert len(pins) == 1, f"expected exactly one ray==X pin in pyproject.toml, found {pins}"
    return pins[0]


def _ray_version_of_image(image: str) -> str | None:
    """rayproject/ray:2.60.0-py311-gpu -> 2.60.0; ghcr.io/x/raytorch:0.1.0-ray2.60.0-gpu -> 2.60.0."""
    match = re.search(r"rayproject/ray(?:-ml)?:([0-9]+\.[0-9]+\.[0-9]+)", image) or re.search(
        r":[^/]*\bray-?([0-9]+\.[0-9]+\.[0-9]+)", image
    )
    return match.group(1) if match else None


def _serve_yaml() -> dict[str, Any]:
    return _load_yaml(CLUSTER / "serve.yaml")


def _strip_artifacts(applications: list[dict[str, Any]]) -> list[dict[str, Any]]:
    apps = copy.deepcopy(applications)
    for app in apps:
        args = app.get("args", {})
        for model in [args.get("model") or {}] + [
            m for m in args.get("models", []) if isinstance(m, dict)
        ]:
            model.pop("artifact", None)
    return apps


@pytest.mark.unit
@pytest.mark.parametrize("name", REQUIRED_FILES)
def test_required_file_exists(name: str) -> None:
    assert (CLUSTER / name).is_file(), f"cluster/{name} is missing"


@pytest.mark.unit
def test_every_yaml_and_json_file_parses() -> None:
    files = sorted(
        p for p in CLUSTER.rglob("*") if p.suffix in (".yaml", ".yml", ".json") and p.is_file()
    )
    assert len(files) >= 8, files
    for path in files:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        assert isinstance(data, dict) and data, (
            f"{path.relative_to(REPO)} is empty or not a mapping"
        )
    service = _load_yaml(KUBERAY / "rayservice.yaml")
    assert isinstance(yaml.safe_load(service["spec"]["serveConfigV2"]), dict)


@pytest.mark.unit
@pytest.mark.parametrize("filename", sorted(MANIFESTS))
def test_kuberay_manifest_validates_against_crd(filename: str) -> None:
    manifest = _load_yaml(KUBERAY / filename)
    kind = MANIFESTS[filename]
    assert manifest["apiVersion"] == "ray.io/v1"
    assert manifest["kind"] == kind
    schema = _crd_schema(kind)
    jsonschema.validate(manifest, schema)
    assert _unknown_fields(manifest, schema) == [], "fields the CRD does not define"


@pytest.mark.unit
def test_unknown_field_check_catches_a_typo() -> None:
    manifest = _load_yaml(KUBERAY / "raycluster.yaml")
    manifest["spec"]["workerGroupSpecs"][0]["minReplica"] = 1
    schema = _crd_schema("RayCluster")
    jsonschema.validate(manifest, schema)  # the schema alone lets it through ...
    assert _unknown_fields(manifest, schema) == ["spec.workerGroupSpecs[0].minReplica"]


@pytest.mark.unit
def test_kuberay_clusters_use_token_auth_and_autoscale_gpu_workers() -> None:
    for filename in MANIFESTS:
        manifest = _load_yaml(KUBERAY / filename)
        spec = manifest["spec"]
        cluster = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec
        assert cluster["authOptions"]["mode"] == "token", filename
        assert cluster["enableInTreeAutoscaling"] is True, filename
        gpu_groups = [
            g
            for g in cluster["workerGroupSpecs"]
            if any(
                "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
                for c in g["template"]["spec"]["containers"]
            )
        ]
        assert gpu_groups, f"{filename}: no GPU worker group"
        for group in gpu_groups:
            assert 0 <= group["minReplicas"] <= group["maxReplicas"], filename


@pytest.mark.unit
def test_the_rayjob_trains_elastically_within_its_gpu_group() -> None:
    """The job's worker range is what its GPU group can hold: min pods up from the start, the
    autoscaler allowed up to max (one GPU pod a worker)."""
    import shlex

    from app.config import load_config

    job = _load_yaml(KUBERAY / "rayjob.yaml")
    args = shlex.split(job["spec"]["entrypoint"])
    overrides = [a for a in args[args.index("--config") + 2 :] if "=" in a]
    train = load_config(REPO / "configs" / "digits.yaml", overrides).train
    assert train.elastic and train.use_gpu and train.max_failures > 0
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert group["minReplicas"] * gpus >= train.min_workers
    assert group["maxReplicas"] * gpus >= train.max_workers
    assert job["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is True


@pytest.mark.unit
def test_rayjob_runs_the_pipeline() -> None:
    job = _load_yaml(KUBERAY / "rayjob.yaml")
    assert job["spec"]["entrypoint"].startswith(
        "python -m jobs.pipeline --config configs/digits.yaml"
    )
    assert (REPO / "configs" / "digits.yaml").is_file()


@pytest.mark.unit
def test_serve_yaml_is_a_valid_serve_deploy_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = _serve_yaml()
    deploy = ServeDeploySchema.model_validate(config)
    # Serve's deploy-config default host is 0.0.0.0: the file must pin loopback.
    assert deploy.http_options.host == "127.0.0.1"
    assert deploy.http_options.port == 8000
    # Exactly what jobs.deploy would write for these models (app.serve.control.builders.applications).
    from app.serve.control.builders import applications

    apps = config["applications"]
    models = [a["args"]["model"] for a in apps if "model" in a["args"]]
    assert models and all(m["name"] and m["artifact"] for m in models)
    serve = ServeConfig.model_validate(apps[0]["args"]["serve"])  # every key is a field
    assert serve.batching.max_batch_size <= serve.max_ongoing_requests
    written = copy.deepcopy(apps)
    for app in written:  # the file may leave fields at their defaults; deploy writes them all
        app["args"]["serve"] = ServeConfig.model_validate(app["args"]["serve"]).model_dump(
            mode="json"
        )
    assert written == applications(models, serve.model_dump(mode="json"))
    assert apps[-1]["name"] == ServeConfig().app_name and apps[-1]["route_prefix"] == "/"


@pytest.mark.unit
def test_rayservice_carries_the_serve_yaml_application() -> None:
    service = _load_yaml(KUBERAY / "rayservice.yaml")
    serve_v2 = yaml.safe_load(service["spec"]["serveConfigV2"])
    local = _serve_yaml()["applications"]
    remote = serve_v2["applications"]
    assert _strip_artifacts(remote) == _strip_artifacts(local)
    for app in remote:
        if "model" in app["args"]:
            assert "://" in app["args"]["model"]["artifact"], "artifacts from shared storage"
    # In a pod Serve must listen beyond loopback, so the API key must be required there.
    assert serve_v2["http_options"]["host"] == "0.0.0.0"
    env = _walk(service["spec"]["rayClusterConfig"], "env")
    api_keys = [e for group in env for e in group if e["name"] == "RAYTORCH_API_KEY"]
    assert api_keys and all(
        not e["valueFrom"]["secretKeyRef"].get("optional", False) for e in api_keys
    )


@pytest.mark.unit
def test_one_ray_version_everywhere() -> None:
    pin = _pinned_ray_version()
    seen: dict[str, str | None] = {}

    froms = re.findall(r"^FROM\s+(\S+)", (CLUSTER / "Dockerfile").read_text(), re.MULTILINE)
    assert froms, "Dockerfile has no FROM"
    for image in froms:
        seen[f"Dockerfile FROM {image}"] = _ray_version_of_image(image)

    launcher = _load_yaml(CLUSTER / "launcher" / "aws-gpu.yaml")
    for image in (
        _walk(launcher, "image") + _walk(launcher, "head_image") + _walk(launcher, "worker_image")
    ):
        seen[f"launcher image {image}"] = _ray_version_of_image(image)
    assert any(k.startswith("launcher image") for k in seen)

    for filename in MANIFESTS:
        manifest = _load_yaml(KUBERAY / filename)
        versions = _walk(manifest, "rayVersion")
        assert versions, f"{filename} has no rayVersion"
        for version in versions:
            seen[f"{filename} rayVersion {version}"] = str(version)
        images = _walk(manifest, "image")
        assert images, f"{filename} names no image"
        for image in images:
            seen[f"{filename} image {image}"] = _ray_version_of_image(image)

    wrong = {where: version for where, version in seen.items() if version != pin}
    assert not wrong, f"pyproject pins ray=={pin}; these disagree: {wrong}"


@pytest.mark.unit
def test_launcher_config_matches_ray_schema() -> None:
    import ray

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = _load_yaml(CLUSTER / "launcher" / "aws-gpu.yaml")
    jsonschema.validate(config, schema)
    node_types = config["available_node_types"]
    assert config["head_node_type"] in node_types
    assert any(
        t["node_config"]["InstanceType"].startswith(("g", "p")) and t.get("max_workers", 0) > 0
        for t in node_types.values()
    ), "no GPU worker node type"


@pytest.mark.unit
def test_runtime_env_skips_local_state() -> None:
    env = _load_yaml(CLUSTER / "runtime_env.yaml")
    excludes = {e.rstrip("/") for e in env["excludes"]}
    assert {".git", ".venv", "outputs", "bench/results"} <= excludes
    assert all(isinstance(v, str) for v in env.get("env_vars", {}).values())
    assert "RAYTORCH_ROOT" not in env.get("env_vars", {})  # the cluster's environment sets it


@pytest.mark.unit
def test_prometheus_scrapes_ray_service_discovery() -> None:
    config = _load_yaml(CLUSTER / "monitoring" / "prometheus.yml")
    files = [
        f
        for job in config["scrape_configs"]
        for sd in job.get("file_sd_configs", [])
        for f in sd["files"]
    ]
    assert "/tmp/ray/prom_metrics_service_discovery.json" in files


@pytest.mark.unit
def test_grafana_dashboard_covers_training_and_serving_metrics() -> None:
    dashboard = json.loads((CLUSTER / "monitoring" / "grafana-dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in (
        "ray_raytorch_train_loss",
        "ray_raytorch_val_loss",
        "ray_raytorch_val_accuracy",
        "ray_raytorch_samples_per_second",
        "ray_raytorch_data_wait_fraction",
        "ray_raytorch_requests_total",
        "ray_raytorch_request_latency_ms_bucket",
        "ray_raytorch_batch_size_bucket",
        "ray_serve_deployment_replica_healthy",
        "ray_raytorch_generation_ttft_ms_bucket",
        "ray_raytorch_generation_tpot_ms_bucket",
        "ray_raytorch_generation_running",
        "ray_raytorch_generation_waiting",
        "ray_raytorch_generation_tokens_total",
        "ray_raytorch_generation_kv_cache_tokens",
        "ray_raytorch_generation_ended_total",
        "ray_raytorch_retrieval_latency_ms_bucket",
        "ray_raytorch_retrieval_items_per_request_sum",
        "ray_raytorch_index_version",
    ):
        assert metric in exprs, f"no panel queries {metric}"
    for q in ("0.5", "0.95", "0.99"):
        assert (
            f"histogram_quantile({q}, sum by (le, model) "
            "(rate(ray_raytorch_request_latency_ms_bucket" in exprs
        ), f"no p{q} latency panel"


@pytest.mark.unit
@pytest.mark.parametrize("script", ["start.sh", "stop.sh", "demo.sh"])
def test_scripts_are_strict_bash(script: str) -> None:
    # Running them (`bash -n`, the guards) is tests/integration/test_cluster_scripts.py's job:
    # this tier starts no subprocess.
    text = (CLUSTER / script).read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
