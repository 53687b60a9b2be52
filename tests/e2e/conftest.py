"""E2E fixtures: a real cluster started by cluster/start.sh (token auth, Serve on 127.0.0.1),
jobs run as subprocesses exactly as a user runs them, HTTP over 127.0.0.1, and an S3-compatible
server (moto) on 127.0.0.1 that the cluster and the jobs reach through the standard AWS_* variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import REPO
from tests.s3_server import moto_s3

PY = sys.executable
TEST_API_KEY_ENV = "RAYTORCH_TEST_API_KEY"
TEST_API_KEY = "e2e-test-key-0123456789"
# The key's header: tests/e2e/test_serve.py turns the key on and leaves it on.
API_KEY_HEADER = {"Authorization": f"Bearer {TEST_API_KEY}"}
DASHBOARD = "http://127.0.0.1:8265"
SERVE = "http://127.0.0.1:8000"
GCS = "127.0.0.1:6379"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The README's later commands (`make test-all`) run after every other e2e test: they
    undeploy and prune the chain's model and publish new versions over it, which the other
    modules (tests/e2e/test_serve.py) read as the chain left them."""
    later = [
        item
        for item in items
        if item.path.name == "test_readme_commands.py" and item.get_closest_marker("slow")
    ]
    items[:] = [item for item in items if item not in later] + later


def ports_in_use(*ports: int) -> list[int]:
    """Which of the cluster's fixed ports (GCS, dashboard, Serve) something already holds."""
    import socket

    busy = []
    for port in ports:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                busy.append(port)
    return busy


@pytest.fixture(scope="session")
def s3_bucket():
    """An S3 server (moto) on 127.0.0.1 for the whole e2e session. It starts before the cluster
    so that the cluster's processes (Serve replicas, Train workers) inherit its endpoint and
    credentials, as a cluster on a cloud gets them from its environment."""
    with moto_s3() as bucket:
        yield bucket


@pytest.fixture(scope="session")
def cluster(s3_bucket):
    """A fresh local cluster for the e2e session, stopped at the end."""
    import ray

    ray.shutdown()  # integration tests may have left a private local Ray attached to this process
    busy = ports_in_use(6379, 8265, 8000)
    if busy:
        pytest.exit(
            f"ports {busy} are taken (a running Ray cluster?); the e2e tests start their own: run `make cluster-down` first",
            1,
        )
    env = {**os.environ, "RAY_AUTH_MODE": "token", TEST_API_KEY_ENV: TEST_API_KEY}
    env.pop("RAY_ADDRESS", None)
    # Workers on ports the OS picks: the integration tier's private Rays, run beside this one,
    # hand out Ray's default worker range (10002-19999) too.
    env["RAYTORCH_RAY_START_ARGS"] = "--min-worker-port=0 --max-worker-port=0"
    # A throwaway cluster: no draining (saves half a minute of Serve shutdown).
    stop_env = {**env, "RAYTORCH_STOP_GRACE_S": "0"}
    try:
        subprocess.run(["bash", "cluster/start.sh"], cwd=REPO, env=env, check=True, timeout=180)
        yield {"token": read_token()}
    finally:  # a start that failed half-way leaves processes too
        subprocess.run(["bash", "cluster/stop.sh"], cwd=REPO, env=stop_env, timeout=120)


def read_token() -> str:
    return (Path.home() / ".ray" / "auth_token").read_text().strip()


def job_env() -> dict[str, str]:
    # The e2e cluster by address, not "auto": another local Ray (the integration tier's, run at
    # the same time by tests/run.sh) may have rewritten Ray's "current cluster" file.
    return {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": GCS}


def run_job(stage: str, *args: str, timeout: float = 600) -> dict:
    """`python -m jobs.<stage> ...` against the running cluster; returns its summary."""
    proc = subprocess.run(
        [PY, "-m", f"jobs.{stage}", *args],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"jobs.{stage} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


Jobs = dict[str, tuple[str, list[str]]]


def run_jobs(jobs: Jobs, timeout: float = 600) -> dict[str, dict]:
    """Several `python -m jobs.<stage> ...` at once; each one's summary, by key. Any failure
    fails the lot, naming the job, once all have ended."""
    return collect_jobs(jobs, start_jobs(jobs), timeout)


def start_jobs(jobs: Jobs) -> dict[str, subprocess.Popen]:
    return {
        key: start_command([PY, "-m", f"jobs.{stage}", *args], REPO)
        for key, (stage, args) in jobs.items()
    }


def collect_jobs(
    jobs: Jobs, procs: dict[str, subprocess.Popen], timeout: float = 600
) -> dict[str, dict]:
    outputs = {key: output_of(proc, timeout) for key, proc in procs.items()}
    failed = {k: p.returncode for k, p in procs.items() if p.returncode != 0}
    if failed:
        key = next(iter(failed))
        raise AssertionError(
            f"jobs.{jobs[key][0]} ({key}) exited {failed[key]}:\n{outputs[key][1][-3000:]}"
        )
    return {key: json.loads(out.strip().splitlines()[-1]) for key, (out, _) in outputs.items()}


def wait_for(predicate, timeout: float, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def get_json(path: str, **kw) -> dict:
    r = requests.get(f"{SERVE}{path}", timeout=10, **kw)
    r.raise_for_status()
    return r.json()


def live_models() -> list[str]:
    """The names of the models the cluster serves now."""
    return [m["name"] for m in get_json("/v1/models", headers=API_KEY_HEADER)["models"]]


def undeploy(names: list[str], cwd: Path = REPO) -> None:
    """These models taken off the cluster by `jobs.models undeploy`, in one call. The `slow`
    modules do it as they end: their replicas (a share of a CPU each) would otherwise hold the
    CPUs the autoscaling tests and the README's later pipelines need (`make test-all`)."""
    if names:
        run_command([PY, "-m", "jobs.models", "undeploy", *names], cwd)


def checkout_copy(into: Path) -> Path:
    """This checkout's tracked files (and untracked ones git does not ignore) copied to `into`:
    a user's checkout of its own, whose relative default paths land in it, not in the folder
    the suite's cluster has as RAYTORCH_ROOT."""
    import shutil

    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def run_command(argv: list[str], cwd: Path, timeout: float = 600, summary: bool = True) -> dict:
    """A README command as a subprocess from `cwd`, on the suite's cluster; its summary (the
    last line of its output)."""
    return finish_command(start_command(argv, cwd), argv, timeout, summary)


def start_command(argv: list[str], cwd: Path) -> subprocess.Popen:
    """The command started, its output going to files (a pipe nobody reads yet would fill and
    stall a chatty job running in the background)."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by output_of
    proc = subprocess.Popen(argv, cwd=cwd, env=job_env(), stdout=out, stderr=err, text=True)
    proc.logs = (out, err)  # type: ignore[attr-defined]
    return proc


def output_of(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # a job left running holds the cluster's CPUs from the tests after it
        proc.wait()
        raise
    texts = []
    for stream in proc.logs:  # type: ignore[attr-defined]
        stream.seek(0)
        texts.append(stream.read())
        stream.close()
    proc.stderr_text = texts[1]  # type: ignore[attr-defined]
    return texts[0], texts[1]


def finish_command(
    proc: subprocess.Popen, argv: list[str], timeout: float = 600, summary: bool = True
) -> dict:
    out, err = output_of(proc, timeout)
    if proc.returncode != 0:
        shown = " ".join(argv[1:])
        raise AssertionError(f"`{shown}` exited {proc.returncode}:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]) if summary else {}


def predict_input(state: dict, into: Path) -> str:
    """A table for jobs.predict: the prepared val split's rows with an `id` column."""
    import pandas as pd

    from app.data.prepare import read_manifest, split_files

    output = state["prepare"]["output"]
    files = split_files(output, read_manifest(output), "val")
    frame = pd.concat([pd.read_parquet(f) for f in files]).drop(columns=["label"])
    frame.insert(0, "id", range(len(frame)))
    path = into / "predict-input.parquet"
    frame.to_parquet(path)
    return str(path)


@pytest.fixture(scope="session")
def readme_chain(cluster, tmp_path_factory) -> dict:
    """The README's digits chain (tests/readme_commands.py:CHAIN) run as a user runs it: each
    command as shown, in order (`jobs.tune`, which needs only the prepared data, beside the
    steps after training), from the root of a checkout with the shipped config and its
    default paths, on the suite's cluster. Each summary by stage (`verify` for
    `export --verify`), each command's standard error by stage (`stderr`), and `root`."""
    from tests.readme_commands import CHAIN, fill

    root = checkout_copy(tmp_path_factory.mktemp("checkout"))
    state: dict = {"root": root, "output": str(root / "predictions")}
    [tune] = [c for c in CHAIN if "jobs.tune" in c]
    tuning = None  # started once training is done: it needs only the prepared data
    for command in CHAIN:
        if "jobs.predict" in command:
            state["input"] = predict_input(state, root)
        argv = fill(command, state)
        stage = "verify" if "--verify" in argv else argv[2].removeprefix("jobs.")
        if command == tune and tuning is not None:
            state[stage] = finish_command(tuning, argv)
            continue
        proc = start_command(argv, root)
        state[stage] = finish_command(proc, argv)
        state.setdefault("stderr", {})[stage] = proc.stderr_text  # type: ignore[attr-defined]
        if stage == "train":
            tuning = start_command(fill(tune, state), root)
    return state


class ClosedLoop:
    """Closed-loop load: `threads` threads each calling `self._run` until the block ends."""

    def __init__(self, threads: int):
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
