"""The files under cluster/ are well formed and agree with each other and with the project.

- every YAML / JSON file parses;
- the KubeRay manifests validate against the v1 schemas of the KubeRay CRDs (and use no field the
  CRDs do not know, which the API server would silently prune);
- cluster/serve.yaml is a valid Serve deploy config whose `serve` args are a valid ServeConfig, and
  the RayService carries the same application (only the artifact URIs differ);
- one Ray version everywhere: pyproject's pin, the Dockerfile, the launcher and every manifest;
- cluster/start.sh refuses a public bind without auth before it starts anything.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import stat
import subprocess
import sys
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
        for model in app.get("args", {}).get("models", []):
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
    (app,) = config["applications"]
    assert app["name"] == ServeConfig().app_name
    assert app["import_path"] == "app.serve.app:build_app"
    assert app["route_prefix"] == "/"
    models = app["args"]["models"]
    assert models and all(m["name"] and m["artifact"] for m in models)
    serve = ServeConfig.model_validate(app["args"]["serve"])  # every key is a ServeConfig field
    assert serve.max_batch_size <= serve.max_ongoing_requests


@pytest.mark.unit
def test_rayservice_carries_the_serve_yaml_application() -> None:
    service = _load_yaml(KUBERAY / "rayservice.yaml")
    serve_v2 = yaml.safe_load(service["spec"]["serveConfigV2"])
    local = _serve_yaml()["applications"]
    remote = serve_v2["applications"]
    assert _strip_artifacts(remote) == _strip_artifacts(local)
    for app in remote:
        for model in app["args"]["models"]:
            assert "://" in model["artifact"], "the cluster reads artifacts from shared storage"
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
        "ray_raytorch_replicas",
        "ray_serve_deployment_replica_healthy",
    ):
        assert metric in exprs, f"no panel queries {metric}"
    for q in ("0.5", "0.95", "0.99"):
        assert (
            f"histogram_quantile({q}, sum by (le, model) "
            "(rate(ray_raytorch_request_latency_ms_bucket" in exprs
        ), f"no p{q} latency panel"


@pytest.mark.unit
@pytest.mark.parametrize("script", ["start.sh", "stop.sh"])
def test_scripts_are_valid_bash(script: str) -> None:
    path = CLUSTER / script
    assert "set -euo pipefail" in path.read_text()
    subprocess.run(["bash", "-n", str(path)], check=True)


# --- cluster/start.sh's guard, run against a fake `ray` so nothing can start ------------------


def _sandbox(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of start.sh in a fake repo whose .venv/bin/ray only records its calls and fails."""
    repo = tmp_path / "repo"
    (repo / "cluster").mkdir(parents=True)
    (repo / "cluster" / "start.sh").write_text((CLUSTER / "start.sh").read_text())
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "ray-calls.log"
    fake_ray = bin_dir / "ray"
    fake_ray.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> "{calls}"\n'
        f'env | grep -E "^(RAY_|RAYTORCH_)" | sort > "{calls}.env"\n'
        "exit 1\n"
    )
    fake_ray.chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    home = tmp_path / "home"
    home.mkdir()
    return repo, home, calls


def _run_start(repo: Path, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTORCH_"))}
    base.update(HOME=str(home), **env)
    return subprocess.run(
        ["bash", str(repo / "cluster" / "start.sh")],
        env=base,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.unit
def test_start_refuses_public_bind_without_api_key_in_the_real_repo() -> None:
    # The exact command users run; it must refuse before touching Ray (exit 2 comes first).
    env = {k: v for k, v in os.environ.items() if k != "RAYTORCH_API_KEY"}
    env["RAYTORCH_BIND_HOST"] = "0.0.0.0"
    env.pop("RAY_AUTH_MODE", None)
    result = subprocess.run(
        ["bash", "cluster/start.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refusing to bind 0.0.0.0" in result.stderr
    assert "RAYTORCH_API_KEY" in result.stderr


@pytest.mark.unit
@pytest.mark.parametrize(
    "env",
    [
        {"RAYTORCH_BIND_HOST": "0.0.0.0"},
        {"RAYTORCH_BIND_HOST": "192.168.1.10", "RAYTORCH_API_KEY": ""},
        {"RAYTORCH_BIND_HOST": "0.0.0.0", "RAYTORCH_API_KEY": "k", "RAY_AUTH_MODE": "disabled"},
    ],
    ids=["no-api-key", "empty-api-key", "auth-disabled"],
)
def test_start_refuses_public_bind_before_starting_anything(
    tmp_path: Path, env: dict[str, str]
) -> None:
    repo, home, calls = _sandbox(tmp_path)
    result = _run_start(repo, home, **env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refusing to bind" in result.stderr
    assert not calls.exists(), "start.sh ran `ray` although it refused"
    assert not (home / ".ray").exists(), "start.sh wrote a token although it refused"


@pytest.mark.unit
@pytest.mark.parametrize(
    "env",
    [
        {},
        {"RAYTORCH_BIND_HOST": "0.0.0.0", "RAYTORCH_API_KEY": "k"},
        {"RAYTORCH_NUM_CPUS": "2", "RAYTORCH_METRICS_PORT": "9999"},
    ],
    ids=["loopback", "public-with-auth-and-key", "cpus-and-metrics-port"],
)
def test_start_passes_the_guard_and_writes_a_private_token(
    tmp_path: Path, env: dict[str, str]
) -> None:
    repo, home, calls = _sandbox(tmp_path)
    result = _run_start(repo, home, **env)
    # The fake `ray start` fails, so the script stops there with 1 (not the guard's 2).
    assert result.returncode == 1, result.stdout + result.stderr
    invoked = calls.read_text().splitlines()
    assert invoked[0] == "status"
    start = invoked[1].split()
    assert start[:2] == ["start", "--head"]
    host = env.get("RAYTORCH_BIND_HOST", "127.0.0.1")
    assert start[start.index("--dashboard-host") + 1] == host
    port = env.get("RAYTORCH_METRICS_PORT", "8080")
    assert start[start.index("--metrics-export-port") + 1] == port
    if "RAYTORCH_NUM_CPUS" in env:
        assert start[start.index("--num-cpus") + 1] == env["RAYTORCH_NUM_CPUS"]
    seen_env = dict(
        line.split("=", 1) for line in Path(f"{calls}.env").read_text().splitlines() if "=" in line
    )
    assert seen_env["RAY_AUTH_MODE"] == "token"
    assert seen_env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert seen_env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert seen_env["RAYTORCH_ROOT"] == str(repo)
    token_file = home / ".ray" / "auth_token"
    token = token_file.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token not in result.stdout + result.stderr, "the token leaked into the output"
