"""B6 autoscaling: time from the start of load to a second model replica answering requests.

The project's Serve app (app.serve.app.build_app, digits int8) with autoscaling min 1 / max 2 and
short delays (target 2 ongoing requests, upscale_delay_s 1, metrics every 0.5 s, 2 s look-back)
receives closed-loop load from 8 connections (bench.load). Every answer carries the model
replica's pid (`x-model-replica`); the clock stops at the first answer from a second pid. Serve's
own view (two replicas RUNNING in serve.status()) is recorded beside it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.common import (
    bench_config,
    ensure_artifact,
    free_port,
    main_wrapper,
    private_ray,
    write_result,
)
from bench.load import LoadGenerator, summarize, wait_ready

ID = "B6"
WHAT = "autoscaling: start of load -> a second model replica serving (min 1, max 2)"
GOAL = "<= 10 s"
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 1,
    "downscale_delay_s": 600,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
}


def running_replicas(serve) -> int:
    try:
        app = serve.status().applications["models"]
        return int(app.deployments["model-digits"].replica_states.get("RUNNING", 0))
    except Exception:  # noqa: BLE001 - a status hiccup is not a result
        return -1


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    import requests

    from app.serve.app import build_app
    from bench.b5_serve import request_body

    started = time.perf_counter()
    artifact = ensure_artifact(work, "digits", smoke)["artifact"]
    overrides = [f"serve.autoscaling.{k}={v}" for k, v in AUTOSCALING.items()]
    config = bench_config(work, "digits", *overrides)
    body = request_body(config)
    timeout_s = 45.0 if smoke else 60.0
    after_s = 0.0 if smoke else 4.0
    with private_ray() as ray_info:
        from ray import serve

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        infer = f"{url}/v2/models/digits/infer"
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            args = {"models": [{"name": "digits", "artifact": artifact}], "serve": config.serve.model_dump(mode="json")}
            serve.run(build_app(args), name="models", route_prefix="/")
            wait_ready(url, 120)
            first = requests.post(infer, data=body, headers={"Content-Type": "application/json"}, timeout=30)
            first_replica = first.headers.get("x-model-replica")
            replicas_before = running_replicas(serve)
            gen = LoadGenerator(infer, body, connections=8, max_requests=50_000).start()
            t0 = gen.started_at
            second_at = status_two_at = None
            checked = 0
            while time.perf_counter() - t0 < timeout_s:
                time.sleep(0.1)
                records = gen.records[checked:]
                checked += len(records)
                for _, end, status, replica in records:
                    if status == 200 and replica and replica != first_replica:
                        second_at = end if second_at is None else min(second_at, end)
                if status_two_at is None and running_replicas(serve) >= 2:
                    status_two_at = time.perf_counter()
                if second_at is not None and (status_two_at is not None or time.perf_counter() - second_at > 3):
                    break
            if second_at is not None and after_s:
                time.sleep(after_s)
            t_end = time.perf_counter()
            gen.stop()
        finally:
            serve.shutdown()
    scale_s = (second_at - t0) if second_at is not None else None
    split = second_at if second_at is not None else t_end
    details = {
        "autoscaling": AUTOSCALING,
        "load": {"connections": 8, "client": "threads + requests.Session (keep-alive), closed loop, 127.0.0.1"},
        "first_replica": first_replica,
        "running_replicas_before_load": replicas_before,
        "second_replica_serving_s": scale_s,
        "serve_status_two_running_s": (status_two_at - t0) if status_two_at is not None else None,
        "timeout_s": timeout_s,
        "before_second_replica": summarize(gen.records, t0, split),
        "after_second_replica": summarize(gen.records, split, t_end) if second_at is not None else None,
        **ray_info,
        "method": (
            "Clock starts when the load threads start; it stops at the end of the first 200 answer "
            "whose x-model-replica differs from the replica that answered before the load. That "
            "covers the autoscaler's metrics delay and look-back, upscale_delay_s, scheduling a "
            "new replica actor (a fresh worker process on a loaded 2-core machine), loading and "
            "verifying the artifact and the ONNX session, and the router learning about it."
        ),
    }
    if scale_s is None:
        summary = f"no second replica within {timeout_s:.0f}s"
    else:
        summary = f"second replica serving {scale_s:.1f}s after load start"
        if status_two_at is not None:
            summary += f" (serve.status 2 RUNNING at {status_two_at - t0:.1f}s)"
    met = bool(scale_s is not None and scale_s <= 10.0)
    return write_result(
        ID, "seconds_to_second_replica_serving", scale_s, GOAL, met, details, out,
        what=WHAT, summary=summary, mode="smoke" if smoke else "full", elapsed_s=time.perf_counter() - started,
    )


def main(argv=None) -> None:
    main_wrapper(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
