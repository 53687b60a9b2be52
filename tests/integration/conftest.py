"""Integration fixtures: a real local Ray (started once, 2 CPUs as on the CI machine) and
prepared datasets under one session temp folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.config import Config
from app.hooks import HOOKS_ENV
from app.pipeline.stages import prepare
from app.ray_runtime import init_private_ray
from tests.conftest import REPO, make_config

# Every process of this tier's Ray (Serve replicas too) installs the tests' fault hooks; they act
# only on requests that carry their seeds (tests/fault_hooks.py). Set before any Ray starts.
os.environ[HOOKS_ENV] = "tests.fault_hooks"


def ensure_local_ray() -> None:
    import ray

    if not ray.is_initialized():
        # address="local": always a private cluster, never a developer's running one.
        init_private_ray()


def multinode_cluster():
    """A `ray.cluster_utils.Cluster` whose head (no CPUs: it runs no worker) holds none of Ray's
    fixed ports (dashboard 8265, agent 52365): the e2e tier's cluster, which needs them, may be
    starting beside this tier (tests/run.sh)."""
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 0, "include_dashboard": False, "dashboard_agent_listen_port": None}
    return Cluster(initialize_head=True, head_node_args=head)


@pytest.fixture
def ray_local():
    ensure_local_ray()
    yield


@pytest.fixture(autouse=True)
def _private_ray_only(request):
    """Each test finds this tier's private Ray up, unless its module starts its own (`OWN_RAY`):
    a stage that connects by itself would otherwise join "the current cluster", which may be
    the e2e tier's (tests/run.sh runs the tiers side by side), or start one with a dashboard
    on the port that cluster needs."""
    if not getattr(request.module, "OWN_RAY", False):
        ensure_local_ray()


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_end():
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("integration")


def workload_config(workspace: Path, workload: str, *overrides: str) -> Config:
    return make_config(workspace / workload, *overrides, path=REPO / "configs" / f"{workload}.yaml")


@pytest.fixture(scope="session")
def prepared(workspace):
    """workload -> its prepared config (each workload prepared once per session)."""
    done: dict[str, Config] = {}

    def get(workload: str) -> Config:
        if workload not in done:
            config = workload_config(workspace, workload)
            ensure_local_ray()  # module fixtures call this before the autouse fixture has run
            prepare(config)
            done[workload] = config
        return done[workload]

    return get


# Short runs that still reach each workload's bar on 2 CPUs (see configs/ for the full ones).
# Digits trains on two ranks (tests/integration/test_train.py asserts it); the others on one,
# since nothing read from them depends on the rank count and each rank's start-up (a process
# importing Ray Train and torch) costs as much CPU as their training does.
SHORT_RUNS = {
    "digits": ["train.epochs=5", "train.keep_checkpoints=5"],
    "tabular": ["train.epochs=5", "train.num_workers=1"],
    "text": ["train.epochs=3", "train.num_workers=1"],
}

EVERY_FORMAT = ("tabular",)  # exported with export.formats=[onnx,aoti,executorch]


def mlflow_uri(workspace: Path) -> str:
    """The session's MLflow tracking store (MLflow 3 refuses plain file stores by default)."""
    return f"sqlite:///{workspace / 'mlflow.db'}"


@pytest.fixture(scope="session")
def trained(prepared, workspace):
    """workload -> (config, train summary), trained once per session on the local Ray.

    Every run writes TensorBoard events; digits also logs to MLflow (tests/integration/
    test_tracking.py reads both back)."""
    from app.train.driver import train

    done: dict[str, tuple[Config, dict]] = {}

    def get(workload: str) -> tuple[Config, dict]:
        if workload not in done:
            prepared(workload)
            ensure_local_ray()
            config = workload_config(
                workspace,
                workload,
                *SHORT_RUNS[workload],
                "train.log_every_steps=1000",
                f"train.run_name={workload}-short",
            )
            with pytest.MonkeyPatch.context() as env:
                if workload == "digits":
                    env.setenv("MLFLOW_TRACKING_URI", mlflow_uri(workspace))
                done[workload] = (config, train(config))
        return done[workload]

    return get


@pytest.fixture(scope="session")
def exported(trained):
    """workload -> (config, jobs.export's result) of the short run, exported once per session
    (export, batch-independence and predict tests read the same artifact). Tabular's artifact
    carries every program format too (tests/integration/test_programs.py)."""
    from app.export.exporter import export

    done: dict[str, tuple[Config, dict]] = {}

    def get(workload: str) -> tuple[Config, dict]:
        if workload not in done:
            config, summary = trained(workload)
            if workload in EVERY_FORMAT:
                formats = ["onnx", "aoti", "executorch"]
                export_cfg = config.export.model_copy(update={"formats": formats})
                config = config.model_copy(update={"export": export_cfg})
            done[workload] = (config, export(config, summary["checkpoint"]))
        return done[workload]

    return get
