"""B5a serving overhead: Ray Serve vs plain uvicorn + ONNX Runtime, same handler and model, driven
by wrk (C) so that the client costs little of the 2 shared cores.

- serve: the project's applications (app.serve.control.builders.run_local: the digits model's application,
  whose replica parses the request and owns the ONNX Runtime session, plus the index) in a
  private Ray started with Serve's high-throughput mode (HAProxy in front, direct ingress to the
  replica: bench.serve_child), one model replica;
- plain: bench.plain_server, the same FastAPI app and ClassifierServer in one uvicorn process.

Same serving process count both sides (one), same config (configs/digits.yaml's serve section).
Every request is one digits row as an Open Inference Protocol v2 JSON infer call. Per connection
count (1, 16, 32, 64): 3 windows per side, alternating, each after waiting (bounded) for a quiet
machine; the medians are compared. Goal: Serve/plain req/s >= 0.9 at 16 connections, and Serve's
p50 at most 0.5 ms above plain's at 1 connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import (
    QUIET_BUSY_CORES,
    REPO,
    Bench,
    bench_config,
    bench_main,
    ensure_artifact,
    free_port,
    free_ports,
    median,
    quiet_window,
    ratio,
    server_command,
)
from bench.load import wait_ready, wrk_run

ID = "B5a"
WHAT = "serving overhead: Ray Serve (one application per model, HAProxy) vs plain uvicorn + ONNX Runtime"
GOAL = "Serve/plain req/s >= 0.9 at 16 connections; p50 at 1 connection <= plain + 0.5 ms"
CONNECTIONS = (1, 16, 32, 64)
RUNS = 3
QUIET_WAIT_S = 30.0
HT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def request_body(config) -> bytes:
    from app.data.ingest import iter_shards
    from app.data.prepare import read_manifest, split_files

    frame = next(
        iter_shards(split_files(config.data_output, read_manifest(config.data_output), "val"))
    )
    row = [float(v) for v in frame["image"].iloc[0]]
    tensor = {"name": "image", "datatype": "FP32", "shape": [1, len(row)], "data": row}
    return json.dumps({"inputs": [tensor]}).encode()


def synthetic_body(artifact: str) -> bytes:
    """One row shaped by the artifact's schema (digits: 64 pixel values 0..16, fixed seed): the
    cost of serving does not depend on which row it is."""
    import numpy as np

    from app.config import resolve_uri
    from app.runtime.artifact import open_artifact

    spec = open_artifact(resolve_uri(artifact)).schema["inputs"][0]
    width = int(spec["shape"][-1])
    row = np.random.default_rng(0).integers(0, 17, width).astype(float).tolist()
    tensor = {"name": spec["name"], "datatype": "FP32", "shape": [1, width], "data": row}
    return json.dumps({"inputs": [tensor]}).encode()


def serve_config(work: Path, *overrides: str) -> dict[str, Any]:
    pinned = ("serve.autoscaling.min_replicas=1", "serve.autoscaling.max_replicas=1")
    return bench_config(work, "digits", *pinned, *overrides).serve.model_dump(mode="json")


def _stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """End a child this benchmark started (by its own pid), politely first."""
    if proc.poll() is not None:
        return
    if proc.stdin:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(timeout=timeout)
        return
    except subprocess.TimeoutExpired:
        proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_plain(
    artifact: str, cfg: dict[str, Any], port: int, log: Path, one_call: bool = False
) -> subprocess.Popen:
    extra = ["--one-call"] if one_call else []
    cmd = server_command("bench.plain_server", artifact, port, cfg, *extra)
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)


def start_ht_child(
    artifact: str,
    cfg: dict[str, Any],
    port: int,
    scratch: str,
    log: Path,
    name: str = "digits",
    root: Path = REPO,
    cpus: int = 2,
) -> subprocess.Popen:
    """bench.serve_child from the source tree `root` (first on the PYTHONPATH of the child, its
    Ray and its replicas)."""
    env = {k: v for k, v in os.environ.items() if k not in ("BENCH_RAY_ADDRESS", "RAY_ADDRESS")}
    env.update(HT_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    metrics_port, stats_port = free_ports(2, avoid=[port])  # never the HTTP port
    # HAProxy's files go to a folder of our own, not the shared /tmp/haproxy-serve default.
    env.update(
        {
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(scratch, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(scratch, "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": scratch,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(scratch, "server-state"),
            # Ports of our own: a cluster on this machine may hold HAProxy's defaults (9101, 8404).
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics_port),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port),
            # Shutdown only: direct-ingress replicas otherwise drain for 30 s before the child can exit.
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        }
    )
    cmd = server_command(
        "bench.serve_child", artifact, port, cfg, "--name", name, "--num-cpus", str(cpus)
    )
    with open(log, "wb") as err:
        pipe = subprocess.PIPE  # READY comes on stdout; closing stdin stops the child
        return subprocess.Popen(
            cmd, cwd=root, env=env, stdin=pipe, stdout=pipe, stderr=err, text=True
        )


def wait_child_ready(proc: subprocess.Popen, timeout_s: float, log: Path) -> dict[str, Any]:
    import select

    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"serve child exited with {proc.returncode}: {tail}")
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("READY "):
                return json.loads(line[len("READY ") :])
    raise TimeoutError(f"serve child not ready after {timeout_s:.0f}s")


@contextlib.contextmanager
def serve_and_plain(
    artifact: str,
    cfg: dict[str, Any],
    name: str,
    bodies: list[bytes],
    logs: Path,
    label: str = "",
    one_call: bool = False,
) -> Iterator[tuple[dict[str, str], str, dict[str, Any]]]:
    """Serve (HAProxy -> the model's replica, a Ray of its own) and the plain uvicorn server
    (`one_call`: without batching) on the same artifact, both answering; yields ({"plain",
    "serve"}: their v2 infer URLs, the wrk body file (one body a line), start-up times), and
    stops both (by pid) on the way out."""
    scratch = tempfile.mkdtemp(prefix="bench-haproxy-")
    body_file = os.path.join(scratch, "bodies.jsonl")
    Path(body_file).write_bytes(b"\n".join(bodies) + b"\n")
    suffix = f"_{label}" if label else ""
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)  # runs last
        serve_port, serve_log = free_port(), logs / f"serve_ht{suffix}.log"
        child = start_ht_child(artifact, cfg, serve_port, scratch, serve_log, name)
        stack.callback(_stop, child)
        plain_port = free_port()
        plain = start_plain(
            artifact, cfg, plain_port, logs / f"plain_uvicorn{suffix}.log", one_call
        )
        stack.callback(_stop, plain, 15)
        stack.callback(plain.terminate)
        startup = {"plain_ready_wait_s": wait_ready(f"http://127.0.0.1:{plain_port}", 120)}
        startup["serve"] = wait_child_ready(child, 300, serve_log)
        path = f"/v2/models/{name}/infer"
        urls = {
            "plain": f"http://127.0.0.1:{plain_port}{path}",
            "serve": f"http://127.0.0.1:{serve_port}{path}",
        }
        yield urls, body_file, startup


def measure(
    urls: dict[str, str], body_file: str, smoke: bool, connections=CONNECTIONS
) -> tuple[dict[int, dict[str, list[dict[str, Any]]]], list[dict[str, float]]]:
    """Per connection count and side: RUNS wrk windows, the sides alternating (ABBA), each
    after a bounded wait for a quiet machine (what it was is kept in the window's record)."""
    duration = 2.0 if smoke else 5.0
    runs = 1 if smoke else RUNS
    windows: dict[int, dict[str, list[dict[str, Any]]]] = {}
    quiet: list[dict[str, float]] = []
    for c in connections:
        for name in urls:  # warm-up at this concurrency, not measured
            wrk_run(urls[name], body_file, c, 1.0)
        for i in range(runs):
            for name in list(urls) if i % 2 == 0 else list(urls)[::-1]:
                before = quiet_window(0 if smoke else QUIET_WAIT_S)
                quiet.append(before)
                result = wrk_run(urls[name], body_file, c, duration)
                result.update({f"{k}_before": v for k, v in before.items()})
                windows.setdefault(c, {}).setdefault(name, []).append(result)
    return windows, quiet


def busy_note(quiet: list[dict[str, float]]) -> str:
    busy = [q for q in quiet if q["busy_cores"] >= QUIET_BUSY_CORES]
    return (
        f"{len(busy)} of {len(quiet)} windows started with >= {QUIET_BUSY_CORES} cores busy "
        f"(waited up to {QUIET_WAIT_S:.0f} s for a quiet one; idle servers included)"
    )


def summarize_side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "requests_per_s": median([r["requests_per_s"] for r in runs]),
        "p50_ms": median([r["p50_ms"] for r in runs]),
        "p99_ms": median([r["p99_ms"] for r in runs]),
        "errors": sum(r["errors"] + r["non_2xx"] for r in runs),
        "client_cpu_s_per_window": median([r["client_cpu_s"] for r in runs]),
        "runs": runs,
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke)
    # $B5_ARTIFACT: an already published digits artifact (skips preparing data and training).
    artifact = os.environ.get("B5_ARTIFACT") or ensure_artifact(work, "digits", smoke)["artifact"]
    cfg = serve_config(work)
    logs = work / "b5-logs"
    logs.mkdir(exist_ok=True)
    bodies = [synthetic_body(artifact)]
    with serve_and_plain(artifact, cfg, "digits", bodies, logs) as (urls, body_file, startup):
        windows, quiet = measure(urls, body_file, smoke)
    sides = {c: {name: summarize_side(r) for name, r in by.items()} for c, by in windows.items()}
    ratios = {
        c: ratio(s["serve"]["requests_per_s"], s["plain"]["requests_per_s"])
        for c, s in sides.items()
    }
    p50_gap = sides[1]["serve"]["p50_ms"] - sides[1]["plain"]["p50_ms"]
    headline = ratios[16]
    met = bool(headline >= 0.9 and p50_gap <= 0.5)
    details = {
        "model": "digits int8 artifact (app.export.exporter), one row per request, v2 JSON infer",
        "client": "wrk -t1 -cN, keep-alive, closed loop, 127.0.0.1; Lua script posts the body",
        "by_connections": sides,
        "ratios_rps": ratios,
        "p50_gap_ms_at_1_connection": p50_gap,
        "windows_busy": busy_note(quiet),
        "quiet_before_windows": quiet,
        "startup": startup,
        "serve_config": {
            k: cfg[k]
            for k in (
                "variant",
                "batching",
                "max_ongoing_requests",
                "replica_cpus",
            )
        },
        "method": (
            "Both servers start first, then per connection count each side gets a 1 s warm-up "
            "and 3 windows of 5 s, alternating; requests/s counts 2xx answers (median of 3), p50 "
            "and p99 are wrk's (median of 3). The Serve side is HAProxy -> the model's replica "
            "(direct ingress; no Serve proxy actor, no second deployment); the plain side is one "
            "uvicorn process. Both run the same create_api + ClassifierServer code."
        ),
    }
    summary = "; ".join(
        f"c={c}: plain {s['plain']['requests_per_s']:.0f} req/s p50 {s['plain']['p50_ms']:.2f} ms "
        f"vs Serve {s['serve']['requests_per_s']:.0f} req/s p50 {s['serve']['p50_ms']:.2f} ms "
        f"(x{ratios[c]:.2f})"
        for c, s in sides.items()
    )
    return bench.result(
        "serve_vs_plain_rps_ratio_at_16_connections", headline, met, details, summary
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
