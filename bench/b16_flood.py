"""B16 maximal bad bodies: how fast they are refused, a good client beside them, replica memory.

The digits app on a private Serve (default limits: 4 MiB bodies, 16 ongoing and 64 queued
requests per model replica) gets 4 MiB bodies that claim huge shapes (v2, to the model's
application) or hold millions of empty rows (v1, through the index) while one good client sends
one-row requests. Two phases: one bad connection per kind (the refusal goals), then 16 per kind
(a flood: the peak memory, PSS sampled every 50 ms, of the model and index replicas against
their size at rest; refusal and good-client times recorded).
Goals, one bad connection a kind: a bad body refused in under 50 ms at p50; the good client's
p50 within 2x of its p50 alone (the load generator shares the 2 cores).
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


def replica_pids() -> dict[str, int]:
    """The model and index replica processes, by their process titles (`ray::ServeReplica:...`;
    the benchmarks' private Ray runs no dashboard for the state API)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::ServeReplica:models:"):
            found["index"] = int(entry.name)
        elif title.startswith("ray::ServeReplica:models-digits:"):
            found["model"] = int(entry.name)
    return found


def good_client(url: str, body: bytes, seconds: float) -> dict[str, Any]:
    gen = LoadGenerator(url, body, connections=1).start()
    time.sleep(seconds)
    gen.stop()
    return summarize(gen.records, gen.started_at, time.perf_counter())


def flood(base: str, good: bytes, seconds: float, connections: int) -> dict[str, Any]:
    """`connections` bad clients per body kind beside one good client, for `seconds`."""
    v2, v1 = f"{base}/v2/models/digits/infer", f"{base}/v1/models/digits:predict"
    bad = [
        LoadGenerator(v2, huge_shape_body(), connections=connections).start(),
        LoadGenerator(v1, empty_rows_body(), connections=connections).start(),
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
            result = flood(base, good, seconds, connections=1)  # one bad client a kind
            pids = {pid: name for name, pid in replica_pids().items()}
            with PeakMemory(interval=0.05, processes=lambda: pids) as memory:
                flooded = flood(base, good, seconds, connections=16)
        finally:
            serve.shutdown()
    ratio = result["good_client"]["p50_ms"] / alone["p50_ms"]
    idle = {name: size / MIB for name, size in memory.first_by_kind.items()}
    peak = {name: size / MIB for name, size in memory.max_by_kind.items()}
    details = {
        "good_client_alone": alone,
        **result,
        "good_p50_ratio_flood_vs_alone": ratio,
        "flood_16_connections_a_kind": flooded,
        "pss_mib_under_flood": {"at_rest": idle, "peak": peak},
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
    summary = (
        f"bad bodies refused p50 {result['bad_p50_ms']:.1f} ms p99 {result['bad_p99_ms']:.1f} ms "
        f"({result['bad_requests']} requests); good p50 {alone['p50_ms']:.2f} ms alone vs "
        f"{result['good_client']['p50_ms']:.2f} ms beside them (x{ratio:.2f}); under a flood of 32 "
        f"connections: refusals p50 {flooded['bad_p50_ms']:.0f} ms, good p50 "
        f"{flooded['good_client']['p50_ms']:.0f} ms, peak PSS model "
        f"replica {peak.get('model', 0):.0f} MiB (at rest {idle.get('model', 0):.0f}), index "
        f"{peak.get('index', 0):.0f} MiB (at rest {idle.get('index', 0):.0f})"
    )
    return bench.result("bad_body_refusal_p50_ms", result["bad_p50_ms"], met, details, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
