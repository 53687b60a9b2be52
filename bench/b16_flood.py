"""B16 a flood of maximal bad bodies: what it costs the replicas, and a good client beside it.

The digits app on a private Serve (default limits: 4 MiB bodies, 16 ongoing and 64 queued
requests per model replica) takes 32 connections sending 4 MiB bodies that claim huge shapes or
hold millions of empty rows (v2 to the model's application, v1 through the index), while one
good client sends one-row requests. Measured: the bad requests' time to their 4xx (p50, p99),
the good client's p50 alone and during the flood, and the peak memory (PSS, sampled every 50
ms) of the model replica and the index replica against their size at rest.
Goals: a bad body is refused in under 50 ms at p50; the good client's p50 under the flood within
2x of its p50 alone (both processes share the 2 cores with the load generator itself).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.b5_serve import request_body
from bench.b8_memory import PeakMemory
from bench.common import Bench, bench_config, bench_main, ensure_artifact, free_port, private_ray
from bench.load import LoadGenerator, summarize, wait_ready

WHAT = "flood of 4 MiB bad bodies: replica memory, time to refuse, a good client's latency"
GOAL = "bad body refused < 50 ms at p50; good client's p50 under flood <= 2x alone"
MIB = 2**20


def huge_shape_body(size: int = 4 * MIB - 4096) -> bytes:
    """A v2 body claiming a shape of 999999999 rows, padded to `size` with real numbers."""
    head = b'{"inputs": [{"name": "image", "datatype": "FP32", "shape": [999999999, 64], "data": ['
    count = (size - len(head) - 4) // 2
    return head + b",".join([b"0"] * count) + b"]}]}"


def empty_rows_body(size: int = 4 * MIB - 4096) -> bytes:
    """A v1 body of millions of empty rows (`{"instances": [[], [], ...]}`)."""
    head = b'{"instances": ['
    count = (size - len(head) - 2) // 3
    return head + b",".join([b"[]"] * count) + b"]}"


def replicas(by_kind: dict[str, int]) -> dict[str, float]:
    """The model and index replicas' sizes in MiB, out of a by-process-role table."""
    out = {}
    for kind, size in by_kind.items():
        if "ServeReplica:models-digits" in kind:
            out["model"] = size / MIB
        elif "ServeReplica:models:" in kind:
            out["index"] = size / MIB
    return out


def good_client(url: str, body: bytes, seconds: float) -> dict[str, Any]:
    gen = LoadGenerator(url, body, connections=1).start()
    time.sleep(seconds)
    gen.stop()
    return summarize(gen.records, gen.started_at, time.perf_counter())


def flood(base: str, good: bytes, seconds: float) -> dict[str, Any]:
    v2, v1 = f"{base}/v2/models/digits/infer", f"{base}/v1/models/digits:predict"
    bad = [
        LoadGenerator(v2, huge_shape_body(), connections=16).start(),
        LoadGenerator(v1, empty_rows_body(), connections=16).start(),
    ]
    during = good_client(v2, good, seconds)
    for gen in bad:
        gen.stop()
    refused = []
    for gen in bad:
        refused += [1000 * (end - start) for start, end, status, _ in gen.records]
    statuses: dict[str, int] = {}
    for gen in bad:
        for *_, status, _ in gen.records:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
    from bench.common import percentile

    return {
        "good_client": during,
        "bad_requests": len(refused),
        "bad_statuses": statuses,
        "bad_p50_ms": percentile(refused, 50),
        "bad_p99_ms": percentile(refused, 99),
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    from app.serve.app import run_local

    bench = Bench("B16", GOAL, WHAT, out, smoke)
    artifact = ensure_artifact(work, "digits", smoke)["artifact"]
    config = bench_config(work, "digits", "serve.autoscaling.max_replicas=1")
    good = request_body(config)
    seconds = 5.0 if smoke else 20.0
    with private_ray() as ray_info:
        from ray import serve

        port = free_port()
        base = f"http://127.0.0.1:{port}"
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            models = [{"name": "digits", "artifact": artifact}]
            run_local(models, config.serve.model_dump(mode="json"))
            wait_ready(base, 120)
            alone = good_client(f"{base}/v2/models/digits/infer", good, seconds / 2)
            with PeakMemory(interval=0.05) as memory:
                time.sleep(0.5)  # a first sample of every process at rest
                result = flood(base, good, seconds)
        finally:
            serve.shutdown()
    ratio = result["good_client"]["p50_ms"] / alone["p50_ms"]
    details = {
        "good_client_alone": alone,
        **result,
        "good_p50_ratio_flood_vs_alone": ratio,
        "pss_mib": {"idle": replicas(memory.first_by_kind), "peak": replicas(memory.max_by_kind)},
        "flood_seconds": seconds,
        "ray": ray_info,
        "method": (
            "32 closed-loop connections (16 v2 bodies claiming [999999999, 64], 16 v1 bodies "
            "of empty rows, 4 MiB each) and one good connection (one digits row, v2) for the "
            "flood's duration; the good client alone for half as long before. PSS of the model "
            "and index replica processes sampled every 50 ms."
        ),
    }
    met = bool(result["bad_p50_ms"] < 50 and ratio <= 2.0)
    peak, idle = replicas(memory.max_by_kind), replicas(memory.first_by_kind)
    summary = (
        f"bad bodies refused p50 {result['bad_p50_ms']:.1f} ms p99 {result['bad_p99_ms']:.1f} ms "
        f"({result['bad_requests']} requests); good p50 {alone['p50_ms']:.2f} ms alone vs "
        f"{result['good_client']['p50_ms']:.2f} ms under flood (x{ratio:.2f}); peak PSS model "
        f"replica {peak.get('model', 0):.0f} MiB (at rest {idle.get('model', 0):.0f}), index "
        f"{peak.get('index', 0):.0f} MiB (at rest {idle.get('index', 0):.0f})"
    )
    return bench.result("bad_body_refusal_p50_ms", result["bad_p50_ms"], met, details, summary)


main = bench_main(run, __doc__)

if __name__ == "__main__":
    main()
