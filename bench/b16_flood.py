"""B16 maximal bad bodies: how fast they are refused, a good client beside them, replica memory.

The digits app on Serve as cluster/start.sh runs it (high-throughput mode: HAProxy in front of
the replicas, bench.serve_child in a Ray of its own; default limits: 4 MiB bodies, 16 ongoing
and 64 queued requests per model replica) gets 4 MiB bodies that claim huge shapes (v2, to the
model's application) or hold millions of empty rows (v1, through the index) while one good
client sends one-row requests (wrk, one connection). Two phases: ten bad bodies a second of
each kind (the goals: a body parsed whole would hold its replica 80-380 ms, so the good client
would wait behind most of them), then 16 connections a kind sending back to back (a flood: the
peak memory, PSS sampled every 50 ms, of the model and index replicas against their size at
rest; refusal and good-client times recorded; on 2 cores shared with the load generator the
flood takes the CPU from everyone).
Goals, ten bad bodies a second a kind: a bad body refused in under 50 ms at p50; the good
client's p50 within 2x of its p50 alone.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.b5_serve import _stop, request_body, start_ht_child, wait_child_ready
from bench.b8_memory import PeakMemory
from bench.common import Bench, bench_config, bench_main, ensure_artifact, free_port
from bench.load import LoadGenerator, wrk_run

WHAT = "flood of 4 MiB bad bodies: replica memory, time to refuse, a good client's latency"
GOAL = (
    "bad body refused < 50 ms at p50; good client's p50 beside 10 bad bodies/s a kind <= 2x alone"
)
MIB = 2**20
BAD_INTERVAL_S = 0.1


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
    """One wrk connection: its latency is not the Python bad clients' GIL's."""
    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl") as f:
        f.write(body + b"\n")
        f.flush()
        return wrk_run(url, f.name, 1, seconds)


def flood(
    base: str, good: bytes, seconds: float, connections: int, interval_s: float = 0.0
) -> dict[str, Any]:
    """`connections` bad clients per body kind (each sending a body every `interval_s`, or
    back to back) beside one good client, for `seconds`."""
    v2, v1 = f"{base}/v2/models/digits/infer", f"{base}/v1/models/digits:predict"
    bad = [
        LoadGenerator(v2, huge_shape_body(), connections, interval_s=interval_s).start(),
        LoadGenerator(v1, empty_rows_body(), connections, interval_s=interval_s).start(),
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
    bench = Bench("B16", GOAL, WHAT, out, smoke)
    artifact = ensure_artifact(work, "digits", smoke)["artifact"]
    config = bench_config(work, "digits", "serve.autoscaling.max_replicas=1")
    good = request_body(config)
    seconds = 5.0 if smoke else 20.0
    port, logs = free_port(), work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="b16-haproxy-")
    # Serve as cluster/start.sh runs it: high-throughput mode, HAProxy in front of the replicas.
    child = start_ht_child(
        artifact, config.serve.model_dump(mode="json"), port, scratch, logs / "b16_serve.log"
    )
    try:
        startup = wait_child_ready(child, 300, logs / "b16_serve.log")
        base = f"http://127.0.0.1:{port}"
        alone = good_client(f"{base}/v2/models/digits/infer", good, seconds / 2)
        # Ten bad bodies a second of each kind: each would hold the replica 80-380 ms if it
        # were parsed whole.
        result = flood(base, good, seconds, connections=1, interval_s=BAD_INTERVAL_S)
        pids = {pid: name for name, pid in replica_pids().items()}
        with PeakMemory(interval=0.05, processes=lambda: pids) as memory:
            flooded = flood(base, good, seconds, connections=16)
    finally:
        _stop(child)
        shutil.rmtree(scratch, ignore_errors=True)
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
        "serve_startup": startup,
        "method": (
            "Phase 1: one connection a kind sending a 4 MiB bad body every 0.1 s (v2 claiming "
            "[999999999, 64], v1 of empty rows); phase 2: 16 closed-loop connections a kind. One "
            "good wrk connection (one digits row, v2) for each phase's duration; alone for half "
            "as long before. PSS of the model and index replicas sampled every 50 ms."
        ),
    }
    met = bool(result["bad_p50_ms"] < 50 and ratio <= 2.0)
    summary = (
        f"bad bodies refused p50 {result['bad_p50_ms']:.1f} ms p99 {result['bad_p99_ms']:.1f} ms "
        f"({result['bad_requests']} requests, 10 a second a kind); good p50 {alone['p50_ms']:.2f} ms alone vs "
        f"{result['good_client']['p50_ms']:.2f} ms beside them (x{ratio:.2f}); under a flood of 32 "
        f"connections: refusals p50 {flooded['bad_p50_ms']:.0f} ms, good p50 "
        f"{flooded['good_client']['p50_ms']:.0f} ms, peak PSS model "
        f"replica {peak.get('model', 0):.0f} MiB (at rest {idle.get('model', 0):.0f}), index "
        f"{peak.get('index', 0):.0f} MiB (at rest {idle.get('index', 0):.0f})"
    )
    return bench.result("bad_body_refusal_p50_ms", result["bad_p50_ms"], met, details, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
