"""B5 serving: Ray Serve (the project's app, batching on and off, and Serve's high-throughput
mode) vs plain uvicorn + FastAPI running the same handler in-process, under the same closed-loop
HTTP load.

- serve_batched: app.serve.app.build_app with configs/digits.yaml's serve section (int8, dynamic
  batching max 16 / 5 ms), default Serve mode, one model replica (autoscaling pinned to 1 so
  every variant runs one copy of the model; B6 measures autoscaling);
- serve_unbatched: the same with serve.max_batch_size=1;
- serve_high_throughput: serve_batched in a separate private Ray started with
  RAY_SERVE_THROUGHPUT_OPTIMIZED=1 and RAY_SERVE_ENABLE_HA_PROXY=1 (HAProxy in front, direct
  ingress, gRPC between deployments) - bench.serve_child;
- plain_uvicorn (and plain_uvicorn_unbatched): bench.plain_server (create_api + ModelServer in
  one uvicorn process, no Ray).

Every request is one digits row as an Open Inference Protocol v2 JSON infer call. Load: 8
threads with requests.Session each, closed loop, 127.0.0.1 only, warm-up then fixed windows
(2 rounds x 5 s per variant in full mode, 1 x 2 s in smoke), capped request count (bench.load).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
    bench_config,
    ensure_artifact,
    free_port,
    main_wrapper,
    median,
    private_ray,
    ratio,
    write_result,
)
from bench.load import closed_loop, parent_of, process_tree, wait_ready

ID = "B5"
WHAT = "serving: Ray Serve (batching on/off, high-throughput mode) vs plain uvicorn, same handler"
GOAL = "high-throughput Serve >= 0.9x plain uvicorn requests/s"
CONNECTIONS = 8
HT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def request_body(config) -> bytes:
    from app.data import iter_shards
    from app.prepare import read_manifest, split_files

    frame = next(
        iter_shards(split_files(config.data_output, read_manifest(config.data_output), "val"))
    )
    row = [float(v) for v in frame["image"].iloc[0]]
    tensor = {"name": "image", "datatype": "FP32", "shape": [1, len(row)], "data": row}
    return json.dumps({"inputs": [tensor]}).encode()


def serve_config(work: Path, *overrides: str) -> dict[str, Any]:
    pinned = ("serve.autoscaling.min_replicas=1", "serve.autoscaling.max_replicas=1")
    return bench_config(work, "digits", *pinned, *overrides).serve.model_dump(mode="json")


def load_settings(smoke: bool) -> dict[str, Any]:
    """Per variant: `rounds` windows of `duration_s` (10 s in all in full mode)."""
    return {
        "connections": CONNECTIONS,
        "rounds": 1 if smoke else 2,
        "duration_s": 2.0 if smoke else 5.0,
        "warmup_s": 0.5 if smoke else 1.0,
        "max_requests": 5_000 if smoke else 40_000,
    }


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


def start_plain(artifact: str, cfg: dict[str, Any], port: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "bench.plain_server",
        "--artifact",
        artifact,
        "--port",
        str(port),
        "--serve-json",
        json.dumps(cfg),
    ]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)


def start_ht_child(
    artifact: str, cfg: dict[str, Any], port: int, scratch: str, log: Path
) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("BENCH_RAY_ADDRESS", "RAY_ADDRESS")}
    env.update(HT_ENV)
    # HAProxy's files go to a folder of our own, not the shared /tmp/haproxy-serve default.
    env.update(
        {
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(scratch, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(scratch, "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": scratch,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(scratch, "server-state"),
            # Shutdown only: direct-ingress replicas otherwise drain for 30 s before the child can exit.
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        }
    )
    cmd = [
        sys.executable,
        "-m",
        "bench.serve_child",
        "--artifact",
        artifact,
        "--port",
        str(port),
        "--serve-json",
        json.dumps(cfg),
    ]
    with open(log, "wb") as err:
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
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


def server_root(url: str, body: bytes) -> int | None:
    """The process tree serving `url`: the raylet above the model replica that answers (Ray), or
    the answering process itself (plain uvicorn); found from the x-model-replica header."""
    import requests

    r = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=30)
    pid = int(r.headers.get("x-model-replica", "0") or 0)
    if not pid:
        return None
    node = pid
    for _ in range(4):
        parent = parent_of(node)
        if parent is None or parent <= 1:
            return pid
        if process_tree(parent).get(parent, "").startswith("raylet"):
            return parent
        node = parent
    return pid


def deploy_in_process(artifact: str, cfg: dict[str, Any]) -> float:
    from ray import serve

    from app.serve.app import build_app

    start = time.perf_counter()
    serve.run(
        build_app({"models": [{"name": "digits", "artifact": artifact}], "serve": cfg}),
        name="models",
        route_prefix="/",
    )
    return time.perf_counter() - start


def aggregate(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant over its rounds: mean requests/s and CPU per request, median latencies."""
    cpu: dict[str, float] = {}
    for r in rounds:
        for name, seconds in (r.get("server_cpu_s") or {}).items():
            cpu[name] = cpu.get(name, 0.0) + seconds
    per_request = [
        r["server_cpu_ms_per_request"] for r in rounds if r.get("server_cpu_ms_per_request")
    ]
    return {
        "requests_per_s": sum(r["requests_per_s"] for r in rounds) / len(rounds),
        "p50_ms": median([r["p50_ms"] for r in rounds]),
        "p99_ms": median([r["p99_ms"] for r in rounds]),
        "requests": sum(r["requests"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        "client_cpu_s": sum(r["client_cpu_s"] for r in rounds),
        "server_cpu_s": cpu,
        "server_cpu_ms_per_request": sum(per_request) / len(per_request) if per_request else None,
        "rounds": rounds,
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    from ray import serve

    from app.serve.app import build_app

    started = time.perf_counter()
    artifact = ensure_artifact(work, "digits", smoke)["artifact"]
    body = request_body(bench_config(work, "digits"))
    path = "/v2/models/digits/infer"
    load = load_settings(smoke)
    rounds = load.pop("rounds")
    configs = {
        "batched": serve_config(work),
        "unbatched": serve_config(work, "serve.max_batch_size=1"),
    }
    logs = work / "b5-logs"
    logs.mkdir(exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench-haproxy-")
    urls: dict[str, str] = {}
    startup: dict[str, Any] = {}
    ht_error = None
    results: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)  # runs last
        # Every server is started before any is measured; the high-throughput child (its own
        # Ray, started with the env vars) boots while the others start.
        ht_port, ht_log = free_port(), logs / "serve_ht.log"
        ht = start_ht_child(artifact, configs["batched"], ht_port, scratch, ht_log)
        stack.callback(_stop, ht)
        for mode, cfg in configs.items():
            name = "plain_uvicorn" if mode == "batched" else "plain_uvicorn_unbatched"
            port = free_port()
            proc = start_plain(artifact, cfg, port, logs / f"{name}.log")
            stack.callback(_stop, proc, 15)
            stack.callback(proc.terminate)
            urls[name] = f"http://127.0.0.1:{port}"
        startup["ray"] = stack.enter_context(private_ray())
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        stack.callback(serve.shutdown)
        for mode, cfg in configs.items():
            start = time.perf_counter()
            app = build_app({"models": [{"name": "digits", "artifact": artifact}], "serve": cfg})
            serve.run(app, name=f"models-{mode}", route_prefix=f"/{mode}")
            startup[f"serve_{mode}_deploy_s"] = time.perf_counter() - start
            urls[f"serve_{mode}"] = f"http://127.0.0.1:{port}/{mode}"
        for name, url in urls.items():
            startup[f"{name}_ready_wait_s"] = wait_ready(url, 120)
        try:
            startup["serve_high_throughput"] = wait_child_ready(ht, 240, ht_log)
            urls["serve_high_throughput"] = f"http://127.0.0.1:{ht_port}"
        except (RuntimeError, TimeoutError) as e:
            ht_error = str(e)[-1500:]
        roots = {name: server_root(url + path, body) for name, url in urls.items()}
        order = list(urls)
        for i in range(rounds):
            # ABBA order: a drift in the machine's other load hits every variant alike.
            for name in order if i % 2 == 0 else order[::-1]:
                result = closed_loop(urls[name] + path, body, **load, server_root=roots[name])
                results.setdefault(name, []).append(result)
    variants = {name: aggregate(r) for name, r in results.items()}
    if ht_error is not None:
        nan = float("nan")
        variants["serve_high_throughput"] = {
            "error": ht_error,
            "requests_per_s": nan,
            "p99_ms": nan,
            "errors": 0,
        }

    rps = {k: v["requests_per_s"] for k, v in variants.items()}
    ratios = {
        "high_throughput_vs_plain": ratio(rps["serve_high_throughput"], rps["plain_uvicorn"]),
        "batched_vs_plain": ratio(rps["serve_batched"], rps["plain_uvicorn"]),
        "unbatched_vs_plain": ratio(rps["serve_unbatched"], rps["plain_uvicorn"]),
        "batched_vs_unbatched": ratio(rps["serve_batched"], rps["serve_unbatched"]),
        "plain_batched_vs_unbatched": ratio(rps["plain_uvicorn"], rps["plain_uvicorn_unbatched"]),
        "high_throughput_vs_batched": ratio(rps["serve_high_throughput"], rps["serve_batched"]),
    }
    headline = ratios["high_throughput_vs_plain"]
    errors = sum(v["errors"] for v in variants.values())
    details = {
        "model": "digits int8 artifact (app.export), one row per request, v2 JSON infer",
        "load": {
            **load,
            "client": "threads + requests.Session (keep-alive), closed loop, 127.0.0.1",
        },
        "variants": variants,
        "startup": startup,
        "ratios": ratios,
        "server_cpu_ms_per_request": {
            k: v.get("server_cpu_ms_per_request") for k, v in variants.items()
        },
        "errors": errors,
        "serve_config": {
            k: configs["batched"][k]
            for k in (
                "variant",
                "max_batch_size",
                "batch_wait_timeout_s",
                "max_ongoing_requests",
                "replica_cpus",
                "ingress_cpus",
            )
        },
        "method": (
            "All servers are started first (plain batched and unbatched, the default-mode Serve app "
            "batched at /batched and unbatched at /unbatched, and the high-throughput child), then "
            "measured in turn, ABBA order over the rounds, so that drift in the shared machine's "
            "other load hits every variant alike; idle servers stay up meanwhile. Each window has "
            "its own warm-up; requests/s counts 200 answers finishing in the window (mean over "
            "rounds), p50/p99 are their latencies (median over rounds). The client shares the 2 cores "
            "(client_cpu_s). server_cpu_s sums, per process name, the CPU seconds that the serving "
            "process tree (the uvicorn process, or every process under the Ray node's raylet) used "
            "during the window (/proc). Ray Serve's path is proxy (or HAProxy) -> ingress replica -> "
            "model replica: two extra hops and processes that a single uvicorn process does not pay. "
            "With 8 connections and max_batch_size 16 a batch never fills, so every batched request "
            "waits the full batch_wait_timeout_s (5 ms): batched variants are latency-bound at "
            "about 8 / (5 ms + service time), whatever CPU is left (compare the unbatched ones). In high-"
            "throughput mode Serve binds direct-ingress ports on all interfaces (Ray's behaviour); "
            "the load only ever goes to 127.0.0.1."
        ),
    }
    summary = (
        f"req/s plain {rps['plain_uvicorn']:.0f} (unbatched {rps['plain_uvicorn_unbatched']:.0f}), "
        f"Serve batched {rps['serve_batched']:.0f} "
        f"(x{ratios['batched_vs_plain']:.2f}), unbatched {rps['serve_unbatched']:.0f}, "
        f"high-throughput {rps['serve_high_throughput']:.0f} (x{headline:.2f}); p99 plain "
        f"{variants['plain_uvicorn']['p99_ms']:.0f} ms vs HT {variants['serve_high_throughput']['p99_ms']:.0f} ms"
    )
    cpu = details["server_cpu_ms_per_request"]
    if all(
        isinstance(cpu.get(k), float)
        for k in ("plain_uvicorn", "serve_high_throughput", "serve_batched")
    ):
        summary += (
            f"; server CPU/request plain {cpu['plain_uvicorn']:.1f} ms, HT "
            f"{cpu['serve_high_throughput']:.1f} ms, default {cpu['serve_batched']:.1f} ms"
        )
    return write_result(
        ID,
        "high_throughput_serve_vs_plain_uvicorn_rps_ratio",
        headline,
        GOAL,
        bool(headline >= 0.9),
        details,
        out,
        what=WHAT,
        summary=summary,
        mode="smoke" if smoke else "full",
        elapsed_s=time.perf_counter() - started,
    )


def main(argv=None) -> None:
    main_wrapper(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
