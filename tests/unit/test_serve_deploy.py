"""app/serve/control/deploy.py and app/serve/control/deploy_lock.py without Ray: concurrent deploys under the lock keep
every model, a version that does not come up is rolled back, the API key follows Serve's host."""

from __future__ import annotations

import copy
import json
import threading
import time

import pytest

from app.config import ServeConfig
from app.errors import UserError
from app.serve.control import deploy as deploy_mod
from app.serve.control.builders import applications
from app.serve.control.deploy_lock import DeployLease, hold

pytestmark = pytest.mark.unit


class FakeServe:
    """The Serve REST API as app.serve.control.deploy uses it: one whole-config store. A submit takes effect
    after `write_delay`, long enough for unlocked read-modify-writes to interleave. Models whose
    artifact is in `failing` never start (their deployment is DEPLOY_FAILED); those in `silent`
    start but never answer over HTTP."""

    def __init__(self, apps=None, host="127.0.0.1", failing=(), silent=(), write_delay=0.0):
        self.applications = copy.deepcopy(apps or [])
        self.http = {"host": host, "port": 8000}
        self.failing, self.silent = set(failing), set(silent)
        self.write_delay = write_delay
        self.submits: list[dict] = []
        self.read_barrier: threading.Barrier | None = None
        self._readers: set[int] = set()
        self._lock = threading.Lock()

    def get_serve_details(self) -> dict:
        if self.read_barrier and threading.get_ident() not in self._readers:
            self._readers.add(threading.get_ident())
            self.read_barrier.wait(timeout=10)  # every deploy reads before any writes
        with self._lock:
            apps = copy.deepcopy(self.applications)
        return {"http_options": self.http, "applications": {a["name"]: self._app(a) for a in apps}}

    def _app(self, app: dict) -> dict:
        model = app["args"].get("model")
        states = (
            {
                f"model-{model['name']}": {
                    "status": "DEPLOY_FAILED" if model["artifact"] in self.failing else "HEALTHY",
                    "message": "The deployment failed to start 3 times in a row.\nTraceback ...",
                }
            }
            if model
            else {"index": {"status": "HEALTHY", "message": ""}}
        )
        failed = any(s["status"] == "DEPLOY_FAILED" for s in states.values())
        return {
            "status": "DEPLOY_FAILED" if failed else "RUNNING",
            "message": "",
            "deployed_app_config": app,
            "deployments": states,
        }

    def deploy_applications(self, config: dict) -> None:
        time.sleep(self.write_delay)
        with self._lock:
            self.submits.append(copy.deepcopy(config))
            self.applications = copy.deepcopy(config["applications"])

    def models(self) -> dict[str, str]:
        models = [a["args"]["model"] for a in self.applications if "model" in a["args"]]
        index = [a["args"]["models"] for a in self.applications if "models" in a["args"]]
        # The index lists exactly the models that have an application.
        assert index == ([sorted(m["name"] for m in models)] if models else []), index
        return {m["name"]: m["artifact"] for m in models}

    def answer(self, url: str, model: str, api_key_env: str) -> str:
        """What GET /v2/models/<model> would say: the version folder of the live artifact."""
        artifact = self.models().get(model)
        if artifact is None or artifact in self.silent:
            return "HTTP 404"
        return artifact.rsplit("/", 1)[-1]


def apps_with(*models: tuple[str, str]) -> list[dict]:
    specs = [{"name": n, "artifact": a} for n, a in models]
    return applications(specs, ServeConfig().model_dump(mode="json"))


@pytest.fixture
def serve(monkeypatch):
    def make(**kw) -> FakeServe:
        fake = FakeServe(**kw)
        monkeypatch.setattr(deploy_mod, "serving_version", fake.answer)
        return fake

    monkeypatch.setattr(deploy_mod, "POLL_S", 0.01)
    monkeypatch.delenv("RAYTORCH_API_KEY", raising=False)
    return make


def apply(fake: FakeServe, name: str, version: str, timeout_s: float = 5.0):
    model = {"name": name, "artifact": f"/registry/{name}/{version}"}
    return deploy_mod.apply(fake, ServeConfig(), model, version, timeout_s)


def in_threads(*targets) -> list[BaseException]:
    errors: list[BaseException] = []

    def run(target):
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors


def locked(lease: DeployLease, guard: threading.Lock, body):
    """`body` under `hold` on one in-process DeployLease (the guard plays the actor's one-call-
    at-a-time execution)."""

    def acquire(owner: str, ttl: float) -> bool:
        with guard:
            return lease.acquire(owner, ttl)

    def release(owner: str) -> bool:
        with guard:
            return lease.release(owner)

    def run():
        with hold(acquire, release, ttl_s=30, wait_s=10, poll_s=0.01):
            body()

    return run


def test_unlocked_concurrent_deploys_lose_a_model(serve):
    # The bug the lock exists for: both read the same config, the second write drops a model
    # (and the deploy that lost it, rolling back to what it read, can drop the other one too).
    # Whether the loser notices depends on the threads' timing: it may have seen its model up
    # in the instant before the other write, and then both deploys report success.
    fake = serve(write_delay=0.1)
    fake.read_barrier = threading.Barrier(2)
    in_threads(
        lambda: apply(fake, "digits", "1", timeout_s=0.5),
        lambda: apply(fake, "topics", "1", timeout_s=0.5),
    )
    assert len(fake.models()) < 2, fake.models()


def test_concurrent_deploys_of_different_models_both_end_up_served(serve):
    fake = serve(apps=apps_with(("tabular", "/registry/tabular/4")), write_delay=0.1)
    lease, guard = DeployLease(), threading.Lock()
    errors = in_threads(
        locked(lease, guard, lambda: apply(fake, "digits", "1")),
        locked(lease, guard, lambda: apply(fake, "topics", "2")),
    )
    assert errors == []
    assert fake.models() == {
        "digits": "/registry/digits/1",
        "tabular": "/registry/tabular/4",
        "topics": "/registry/topics/2",
    }
    assert lease.holder() is None


def test_a_new_version_that_fails_to_start_is_rolled_back(serve):
    before = apps_with(("digits", "/registry/digits/1"), ("topics", "/registry/topics/1"))
    fake = serve(apps=before, failing={"/registry/digits/2"})
    with pytest.raises(UserError) as info:
        apply(fake, "digits", "2")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("deploy of digits failed: application DEPLOY_FAILED")
    assert "rolled back to the previous config (digits from /registry/digits/1" in message
    assert "application RUNNING" in message
    assert fake.applications == before  # the previous config, exactly, is what runs now


def test_a_new_model_that_never_answers_is_removed_again(serve):
    before = apps_with(("digits", "/registry/digits/1"))
    fake = serve(apps=before, silent={"/registry/topics/1"})
    with pytest.raises(UserError, match=r"did not come up in time .*no topics \(it was new\)"):
        apply(fake, "topics", "1", timeout_s=0.3)
    assert fake.applications == before


def test_first_deploy_that_fails_leaves_no_application(serve):
    fake = serve(failing={"/registry/digits/1"})
    with pytest.raises(UserError, match="application absent"):
        apply(fake, "digits", "1")
    assert fake.applications == [] and fake.submits[-1]["applications"] == []


def test_deploy_refuses_a_public_serve_without_a_key_before_submitting(serve, monkeypatch):
    fake = serve(host="0.0.0.0")  # http_options from serve.yaml / the RayService
    with pytest.raises(UserError, match=r"Serve listens on 0\.0\.0\.0.*RAYTORCH_API_KEY"):
        apply(fake, "digits", "1")
    assert fake.submits == []
    monkeypatch.setenv("RAYTORCH_API_KEY", "k")
    url, app = apply(fake, "digits", "1")
    assert url == "http://127.0.0.1:8000" and app["args"]["models"] == ["digits"]


def test_deploy_lease_is_exclusive_renewable_and_expires():
    lease = DeployLease()
    assert lease.acquire("a", ttl_s=10, now=0)
    assert not lease.acquire("b", ttl_s=10, now=5)
    assert lease.acquire("a", ttl_s=10, now=5)  # renewal by the holder
    assert not lease.acquire("b", ttl_s=10, now=14)
    assert lease.acquire("b", ttl_s=10, now=15)  # a dead holder's lease expires
    assert not lease.release("a") and lease.holder() == "b"
    assert lease.release("b") and lease.holder() is None


def test_hold_gives_up_with_one_line():
    with (
        pytest.raises(UserError, match="another deploy held the cluster's deploy lock"),
        hold(lambda o, t: False, lambda o: None, ttl_s=1, wait_s=0.05, poll_s=0.01),
    ):
        pass


def test_each_model_is_its_own_application_and_others_apps_are_kept(serve):
    other = {"name": "someone-else", "route_prefix": "/x", "import_path": "x:y", "args": {}}
    fake = serve(apps=[other])
    apply(fake, "tabular", "4")
    apply(fake, "digits", "1")
    by_name = {a["name"]: a for a in fake.applications}
    assert by_name["someone-else"] == other  # applications not ours are kept as they are
    assert by_name["models"]["args"]["models"] == ["digits", "tabular"]
    assert by_name["models-digits"]["route_prefix"] == "/v2/models/digits"
    assert by_name["models-tabular"]["args"]["model"]["artifact"] == "/registry/tabular/4"
    assert fake.models() == {"digits": "/registry/digits/1", "tabular": "/registry/tabular/4"}


def test_without_model_keeps_the_others_untouched():
    cfg = ServeConfig()
    apps = {a["name"]: a for a in apps_with(("digits", "/r/digits/1"), ("topics", "/r/topics/2"))}
    left = deploy_mod.without_model(apps, cfg, "digits")
    assert sorted(left) == ["models", "models-topics"]
    assert left["models-topics"] == apps["models-topics"]
    assert left["models"]["args"]["models"] == ["topics"]
    # The last model gone, the index stays, listing none (GET /v1/models: an empty list).
    none_left = deploy_mod.without_model(left, cfg, "topics")
    assert sorted(none_left) == ["models"] and none_left["models"]["args"]["models"] == []


def test_deploying_one_model_leaves_the_others_applications_exactly_as_they_were():
    """Another model keeps its own serve settings and pinned artifact (a changed config would be
    a new version to Serve: a rolling restart of a model nobody deployed)."""
    apps = {a["name"]: a for a in apps_with(("digits", "/r/digits/1"), ("topics", "/r/topics/2"))}
    apps["models-topics"]["args"]["serve"]["variant"] = "fp32"  # deployed with other settings
    cfg = ServeConfig(api_key_env="OTHER_KEY")
    after = deploy_mod.with_model(apps, cfg, {"name": "digits", "artifact": "/r/digits/3"})
    assert after["models-topics"] == apps["models-topics"]
    assert after["models-digits"]["args"]["model"]["artifact"] == "/r/digits/3"
    assert after["models-digits"]["args"]["serve"]["api_key_env"] == "OTHER_KEY"
    assert after["models"]["args"]["models"] == ["digits", "topics"]


def test_an_index_application_takes_the_search_path_as_its_route(tmp_path):
    """A task's route_prefix part names its application's path: an index's is its one search
    route, so the proxy hands a search straight to the index's replicas; a model of any other
    task (or an artifact that cannot be read) keeps /v2/models/<name>."""
    index = tmp_path / "notes-index" / "1"
    index.mkdir(parents=True)
    (index / "manifest.json").write_text("{}")
    (index / "schema.json").write_text(json.dumps({"task": "index"}))
    (index.parent / "latest").write_text("1")
    apps = apps_with(("notes", str(index.parent / "latest")), ("digits", str(tmp_path / "none")))
    routes = {a["name"]: a["route_prefix"] for a in apps}
    assert routes == {
        "models-notes": "/v1/models/notes:search",
        "models-digits": "/v2/models/digits",
        "models": "/",
    }
