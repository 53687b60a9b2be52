"""A bounded closed-loop HTTP load generator: N threads, each with its own `requests.Session`
(keep-alive connection), sends the next request as soon as the previous answer arrives.

Bounded three ways: a fixed duration, a cap on the total number of requests, and 127.0.0.1 only.
It runs on the same 2 cores as the server under test, so its own CPU time is reported
(`client_cpu_s`): a Python client can itself become the limit at high request rates.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any
from urllib.parse import urlparse

import requests

from bench.common import percentile

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LoadGenerator:
    def __init__(
        self,
        url: str,
        body: bytes,
        connections: int = 8,
        max_requests: int = 100_000,
        headers: dict[str, str] | None = None,
        timeout_s: float = 30.0,
        interval_s: float = 0.0,
    ):
        """`interval_s`: each connection starts a request at most that often (0: closed loop)."""
        host = urlparse(url).hostname
        if host not in LOOPBACK:
            raise ValueError(f"load is only ever sent to loopback, not {host!r}")
        self.url, self.body, self.connections, self.max_requests = (
            url,
            body,
            connections,
            max_requests,
        )
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.timeout_s, self.interval_s = timeout_s, interval_s
        # (start, end, status, replica) per request; list.append is atomic under the GIL.
        self.records: list[tuple[float, float, int, str | None]] = []
        self._sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.started_at = 0.0

    def _take_ticket(self) -> bool:
        with self._lock:
            if self._sent >= self.max_requests:
                return False
            self._sent += 1
            return True

    def _worker(self) -> None:
        session = requests.Session()
        while not self._stop.is_set() and self._take_ticket():
            start = time.perf_counter()
            try:
                response = session.post(
                    self.url, data=self.body, headers=self.headers, timeout=self.timeout_s
                )
                _ = response.content
                status, replica = response.status_code, response.headers.get("x-model-replica")
            except requests.RequestException:
                status, replica = -1, None
            self.records.append((start, time.perf_counter(), status, replica))
            self._stop.wait(max(0.0, start + self.interval_s - time.perf_counter()))
        session.close()

    def start(self) -> LoadGenerator:
        self.started_at = time.perf_counter()
        self._threads = [
            threading.Thread(target=self._worker, daemon=True) for _ in range(self.connections)
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 5)


def summarize(
    records: list[tuple[float, float, int, str | None]], t0: float, t1: float
) -> dict[str, Any]:
    """Requests that finished inside [t0, t1]: throughput, latency percentiles, errors."""
    done = [r for r in records if t0 <= r[1] <= t1]
    ok = [r for r in done if r[2] == 200]
    latencies = [1000 * (end - start) for start, end, _, _ in ok]
    statuses: dict[str, int] = {}
    for r in done:
        statuses[str(r[2])] = statuses.get(str(r[2]), 0) + 1
    window = t1 - t0
    return {
        "window_s": window,
        "requests": len(done),
        "ok": len(ok),
        "errors": len(done) - len(ok),
        "status_counts": statuses,
        "requests_per_s": len(ok) / window if window > 0 else float("nan"),
        "p50_ms": percentile(latencies, 50),
        "p90_ms": percentile(latencies, 90),
        "p99_ms": percentile(latencies, 99),
        "replicas_seen": sorted({r[3] for r in ok if r[3]}),
    }


# --- server-side CPU, read from /proc (Linux): where each request's CPU time goes ----------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user+system CPU seconds) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace")
    if first.startswith("ray::"):  # "ray::ServeReplica:app:dep.method" while running a method
        return first.split()[0].split(".")[0]
    if len(argv) > 2 and argv[1] == b"-m":
        return "python -m " + argv[2].decode(errors="replace")
    return os.path.basename(first) or "?"


def process_tree(root: int) -> dict[int, str]:
    """The root process and all its descendants: pid -> short name."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat:
                parents[int(entry)] = stat[0]
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return {pid: _name(pid) for pid in tree}


def parent_of(pid: int) -> int | None:
    stat = _stat(pid)
    return stat[0] if stat else None


def cpu_by_name(
    root: int, before: dict[int, float] | None = None
) -> tuple[dict[int, float], dict[str, float]]:
    """CPU seconds of every process under `root` (minus `before`), summed by process name."""
    now: dict[int, float] = {}
    totals: dict[str, float] = {}
    for pid, name in process_tree(root).items():
        stat = _stat(pid)
        if stat is None:
            continue
        now[pid] = stat[1]
        delta = stat[1] - (before or {}).get(pid, 0.0)
        totals[name] = totals.get(name, 0.0) + delta
    return now, {k: v for k, v in sorted(totals.items(), key=lambda kv: -kv[1]) if v > 0.005}


def closed_loop(
    url: str,
    body: bytes,
    connections: int = 8,
    duration_s: float = 10.0,
    warmup_s: float = 1.0,
    max_requests: int = 100_000,
    headers: dict[str, str] | None = None,
    server_root: int | None = None,
) -> dict[str, Any]:
    """Warm up, then measure for `duration_s` (or until `max_requests` were sent).

    With `server_root`, the CPU seconds of that process and its descendants over the window are
    reported by process name (`server_cpu_s`), and per answered request (`server_cpu_ms_per_request`).
    """
    gen = LoadGenerator(url, body, connections, max_requests, headers).start()
    time.sleep(warmup_s)
    base = cpu_by_name(server_root)[0] if server_root else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    deadline = t0 + duration_s
    while time.perf_counter() < deadline and any(t.is_alive() for t in gen._threads):
        time.sleep(0.05)
    t1, cpu1 = time.perf_counter(), time.process_time()
    server_cpu = cpu_by_name(server_root, base)[1] if server_root else None
    gen.stop()
    result = summarize(gen.records, t0, t1)
    if server_cpu is not None:
        result["server_cpu_s"] = server_cpu
        total = sum(server_cpu.values())
        result["server_cpu_ms_per_request"] = 1000 * total / result["ok"] if result["ok"] else None
        result["server_cores_busy"] = total / (t1 - t0)
    result.update(
        connections=connections,
        duration_s=duration_s,
        warmup_s=warmup_s,
        max_requests=max_requests,
        client="threads + requests.Session (keep-alive), closed loop",
        client_cpu_s=cpu1 - cpu0,
    )
    return result


def wait_ready(url: str, timeout_s: float = 120.0, path: str = "/v2/health/ready") -> float:
    """Seconds until GET <url><path> answers 200; raises TimeoutError."""
    start = time.perf_counter()
    last = "no answer"
    while time.perf_counter() - start < timeout_s:
        try:
            r = requests.get(url + path, timeout=5)
            if r.status_code == 200:
                return time.perf_counter() - start
            last = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            last = type(e).__name__
        time.sleep(0.25)
    raise TimeoutError(f"{url}{path} not ready after {timeout_s:.0f}s ({last})")


# --- wrk: the C load generator (Debian's `wrk` package; `make bench` installs it) -------------

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
-- One body per line, sent in turn (one line: the same body every time).
local bodies, i = {}, 0
for line in io.lines(os.getenv("WRK_BODY")) do
  if #line > 0 then bodies[#bodies + 1] = line end
end
function request()
  i = i % #bodies + 1
  return wrk.format(nil, nil, nil, bodies[i])
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "errors": %d, "non_2xx": %d, ' ..
    '"p50_ms": %.4f, "p90_ms": %.4f, "p99_ms": %.4f, "mean_ms": %.4f}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50) / 1000, latency:percentile(90) / 1000, latency:percentile(99) / 1000,
    latency.mean / 1000))
end
"""


def wrk_path() -> str:
    import shutil

    path = shutil.which("wrk")
    if path is None:
        raise RuntimeError("wrk is not installed: `apt-get install -y wrk` (make bench does it)")
    return path


def wrk_run(
    url: str, body_file: str, connections: int, duration_s: float, timeout_s: float = 5.0
) -> dict[str, Any]:
    """One wrk window (one client thread, keep-alive connections, closed loop) on loopback,
    posting the JSON bodies of `body_file` (one per line) in turn:
    requests/s counts 2xx answers; p50/p99 from wrk's latency histogram; client CPU from rusage."""
    import json
    import resource
    import subprocess
    import tempfile

    if urlparse(url).hostname not in LOOPBACK:
        raise ValueError(f"load is only ever sent to loopback, not {url!r}")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_SCRIPT)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = max(1, round(duration_s))  # wrk takes whole seconds
    cmd = [wrk_path(), "-t1", f"-c{connections}", f"-d{seconds}s", f"--timeout={timeout_s:g}s"]
    proc = subprocess.run(
        [*cmd, "-s", f.name, url],
        capture_output=True,
        text=True,
        timeout=duration_s + timeout_s + 30,
        env={**os.environ, "WRK_BODY": body_file},
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    os.unlink(f.name)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr[-500:]}")
    out = json.loads(line[len("WRK_JSON ") :])
    seconds = out["duration_us"] / 1e6
    ok = out["requests"] - out["non_2xx"] - out["errors"]
    out.update(
        connections=connections,
        requests_per_s=ok / seconds if seconds else float("nan"),
        client_cpu_s=(after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
    )
    return out
