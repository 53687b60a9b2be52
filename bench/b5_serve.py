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
- plain_uvicorn: bench.plain_server (create_api + ModelServer in one uvicorn process).

Every request is one digits row as an Open Inference Protocol v2 JSON infer call. Load: 8
threads with requests.Session each, closed loop, 127.0.0.1 only, warm-up then a fixed window
(10 s full / 2 s smoke), capped request count (bench.load).
"""

from __future__ import annotations

import json
import os
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
    private_ray,
    ratio,
    write_result,
)
from bench.load import closed_loop, wait_ready

ID = "B5"
WHAT = "serving: Ray Serve (batching on/off, high-throughput mode) vs plain uvicorn, same handler"
GOAL = "high-throughput Serve >= 0.9x plain uvicorn requests/s"
CONNECTIONS = 8
HT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def request_body(config) -> bytes:
    from app.data import iter_shards
    from app.prepare import read_manifest, split_files

    frame = next(iter_shards(split_files(config.data_output, read_manifest(config.data_output), "val")))
    row = [float(v) for v in frame["image"].iloc[0]]
    tensor = {"name": "image", "datatype": "FP32", "shape": [1, len(row)], "data": row}
    return json.dumps({"inputs": [tensor]}).encode()


def serve_config(work: Path, *overrides: str) -> dict[str, Any]:
    pinned = ("serve.autoscaling.min_replicas=1", "serve.autoscaling.max_replicas=1")
    return bench_config(work, "digits", *pinned, *overrides).serve.model_dump(mode="json")


def load_settings(smoke: bool) -> dict[str, Any]:
    return {
        "connections": CONNECTIONS,
        "duration_s": 2.0 if smoke else 10.0,
        "warmup_s": 0.5 if smoke else 1.5,
        "max_requests": 5_000 if smoke else 60_000,
    }


def _stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """End a child this benchmark started (by its own pid), politely first."""
    if proc.poll() is not None:
        return
    if proc.stdin:
        try:
            proc.stdin.close()
        except OSError:
            pass
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
    cmd = [sys.executable, "-m", "bench.plain_server", "--artifact", artifact, "--port", str(port),
           "--serve-json", json.dumps(cfg)]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)


def start_ht_child(artifact: str, cfg: dict[str, Any], port: int, scratch: str, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("BENCH_RAY_ADDRESS", "RAY_ADDRESS")}
    env.update(HT_ENV)
    # HAProxy's files go to a folder of our own, not the shared /tmp/haproxy-serve default.
    env.update({
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(scratch, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(scratch, "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": scratch,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(scratch, "server-state"),
        # Shutdown only: direct-ingress replicas otherwise drain for 30 s before the child can exit.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    })
    cmd = [sys.executable, "-m", "bench.serve_child", "--artifact", artifact, "--port", str(port),
           "--serve-json", json.dumps(cfg)]
    with open(log, "wb") as err:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True)


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
                return json.loads(line[len("READY "):])
    raise TimeoutError(f"serve child not ready after {timeout_s:.0f}s")


def deploy_in_process(artifact: str, cfg: dict[str, Any]) -> float:
    from ray import serve

    from app.serve.app import build_app

    start = time.perf_counter()
    serve.run(build_app({"models": [{"name": "digits", "artifact": artifact}], "serve": cfg}), name="models", route_prefix="/")
    return time.perf_counter() - start


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    artifact = ensure_artifact(work, "digits", smoke)["artifact"]
    config = bench_config(work, "digits")
    body = request_body(config)
    path = "/v2/models/digits/infer"
    load = load_settings(smoke)
    batched_cfg = serve_config(work)
    unbatched_cfg = serve_config(work, "serve.max_batch_size=1")
    logs = work / "b5-logs"
    logs.mkdir(exist_ok=True)
    variants: dict[str, Any] = {}
    scratch = tempfile.mkdtemp(prefix="bench-haproxy-")
    ht_port, ht_log = free_port(), logs / "serve_ht.log"
    ht: subprocess.Popen | None = None
    ht_info: dict[str, Any] | None = None
    ht_error = None
    if smoke:  # overlap the child's Ray start with the other variants; timings do not matter here
        ht = start_ht_child(artifact, batched_cfg, ht_port, scratch, ht_log)
    try:
        # 1. plain uvicorn (no Ray in play)
        port = free_port()
        plain = start_plain(artifact, batched_cfg, port, logs / "plain.log")
        try:
            url = f"http://127.0.0.1:{port}"
            ready = wait_ready(url, 120)
            variants["plain_uvicorn"] = {**closed_loop(url + path, body, **load), "ready_s": ready}
        finally:
            plain.terminate()
            _stop(plain, 15)

        # 2. Serve's high-throughput mode, in its own Ray started with the env vars
        if ht is None:
            ht = start_ht_child(artifact, batched_cfg, ht_port, scratch, ht_log)
        try:
            ht_info = wait_child_ready(ht, 240, ht_log)
        except (RuntimeError, TimeoutError) as e:
            ht_error = str(e)[-1500:]
        if ht_info is not None and not smoke:
            url = f"http://127.0.0.1:{ht_port}"
            variants["serve_high_throughput"] = {**closed_loop(url + path, body, **load), **ht_info}
            _stop(ht)

        # 3. default Serve, batching on then off (the run_all cluster, or a private one)
        with private_ray() as ray_info:
            from ray import serve

            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            try:
                url = f"http://127.0.0.1:{port}"
                for name, cfg in (("serve_batched", batched_cfg), ("serve_unbatched", unbatched_cfg)):
                    deploy_s = deploy_in_process(artifact, cfg)
                    wait_ready(url, 120)
                    variants[name] = {**closed_loop(url + path, body, **load), "deploy_s": deploy_s, **ray_info}
            finally:
                serve.shutdown()
        if ht_info is not None and smoke:
            url = f"http://127.0.0.1:{ht_port}"
            variants["serve_high_throughput"] = {**closed_loop(url + path, body, **load), **ht_info}
    finally:
        if ht is not None:
            _stop(ht)
    if ht_error is not None:
        nan = float("nan")
        variants["serve_high_throughput"] = {"error": ht_error, "requests_per_s": nan, "p99_ms": nan, "errors": 0}

    rps = {k: v["requests_per_s"] for k, v in variants.items()}
    ratios = {
        "high_throughput_vs_plain": ratio(rps["serve_high_throughput"], rps["plain_uvicorn"]),
        "batched_vs_plain": ratio(rps["serve_batched"], rps["plain_uvicorn"]),
        "unbatched_vs_plain": ratio(rps["serve_unbatched"], rps["plain_uvicorn"]),
        "batched_vs_unbatched": ratio(rps["serve_batched"], rps["serve_unbatched"]),
        "high_throughput_vs_batched": ratio(rps["serve_high_throughput"], rps["serve_batched"]),
    }
    headline = ratios["high_throughput_vs_plain"]
    errors = sum(v["errors"] for v in variants.values())
    details = {
        "model": "digits int8 artifact (app.export), one row per request, v2 JSON infer",
        "load": {**load, "client": "threads + requests.Session (keep-alive), closed loop, 127.0.0.1"},
        "variants": variants,
        "ratios": ratios,
        "errors": errors,
        "serve_config": {k: batched_cfg[k] for k in ("variant", "max_batch_size", "batch_wait_timeout_s",
                                                       "max_ongoing_requests", "replica_cpus", "ingress_cpus")},
        "method": (
            "Each variant gets the same warm-up and measuring window; requests/s counts 200 answers "
            "finishing in the window; p50/p99 are their latencies. Variants run one after another "
            "(plain, high-throughput, default batched, default unbatched), each server alone except "
            "for the shared run_all Ray idling in the background. The client shares the 2 cores "
            "(client_cpu_s). Ray Serve's path is proxy (or HAProxy) -> ingress replica -> model replica: "
            "two extra hops and processes that a single uvicorn process does not pay. In high-"
            "throughput mode Serve binds direct-ingress ports on all interfaces (Ray's behaviour); "
            "the load only ever goes to 127.0.0.1."
        ),
    }
    summary = (
        f"req/s plain {rps['plain_uvicorn']:.0f}, Serve batched {rps['serve_batched']:.0f} "
        f"(x{ratios['batched_vs_plain']:.2f}), unbatched {rps['serve_unbatched']:.0f}, "
        f"high-throughput {rps['serve_high_throughput']:.0f} (x{headline:.2f}); p99 plain "
        f"{variants['plain_uvicorn']['p99_ms']:.0f} ms vs HT {variants['serve_high_throughput']['p99_ms']:.0f} ms"
    )
    return write_result(
        ID, "high_throughput_serve_vs_plain_uvicorn_rps_ratio", headline, GOAL, bool(headline >= 0.9), details, out,
        what=WHAT, summary=summary, mode="smoke" if smoke else "full", elapsed_s=time.perf_counter() - started,
    )


def main(argv=None) -> None:
    main_wrapper(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
