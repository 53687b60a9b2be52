"""B5c: the project's Serve application vs LitServe (batching on) on the same artifact and the
same requests, driven by wrk.

- serve: app.serve.control.builders.run_local in a private Ray with Serve's high-throughput mode (HAProxy ->
  the model's replica), one replica, the workload config's serve section (batching on);
- litserve: bench.lit_server, one LitServe worker with max_batch_size / batch_timeout equal to
  serve.batching.max_batch_size / serve.batching.batch_wait_timeout_s, the same validation, preprocessor and int8
  ONNX Runtime session.

The artifact is $B5C_ARTIFACT, or the issue's Transformer (configs/text.yaml's data and tokenizer,
width 256, 4 layers, max_length 128: bench.common.TEXT256) trained briefly and exported once in
the workspace. Text requests are one string of 20-120 tokens each (capped by the tokenizer's max_length), sent
in turn from a fixed set; wrk at 16, 32 and 64 connections, 3 windows per side, alternating, after
a bounded wait for a quiet machine. Goal: Serve >= 1.0x LitServe's req/s at 32 connections with
p99 no worse.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.b5_serve import (
    _stop,
    busy_note,
    measure,
    serve_config,
    start_ht_child,
    summarize_side,
    wait_child_ready,
)
from bench.common import (
    REPO,
    TEXT256,
    Bench,
    bench_main,
    ensure_artifact,
    free_port,
    ratio,
)
from bench.load import wait_ready

ID = "B5c"
WHAT = "serving framework: the project's Ray Serve app vs LitServe (batching on), same artifact"
GOAL = "Serve >= 1.0x LitServe req/s at 32 connections, p99 no worse"
CONNECTIONS = (16, 32, 64)
RUNS = 3
WORDS = [
    "the",
    "a",
    "model",
    "data",
    "cat",
    "dog",
    "runs",
    "over",
    "under",
    "quickly",
    "slowly",
    "serve",
    "batch",
    "token",
    "ray",
]


def request_bodies(artifact_uri: str, n: int = 64) -> tuple[str, list[str], list[int]]:
    """(model name, v2 JSON bodies one per line, tokens per body)."""
    from app.runtime.artifact import open_artifact

    artifact = open_artifact(artifact_uri)
    spec, pre = artifact.schema["inputs"][0], artifact.preprocessor
    rng = np.random.default_rng(0)
    bodies, tokens = [], []
    for _ in range(n):
        if pre.kind == "text":
            limit = int(pre.state["max_length"])
            target = int(rng.integers(min(20, limit), min(120, limit) + 1))
            text = " ".join(rng.choice(WORDS, target))
            while int(pre.features([text])["attention_mask"].sum()) > target and " " in text:
                text = text.rsplit(" ", 1)[0]
            tensor = {"name": spec["name"], "datatype": "BYTES", "shape": [1], "data": [text]}
            tokens.append(int(pre.features([text])["attention_mask"].sum()))
        else:
            row = rng.integers(0, 17, pre.num_features).astype(float).tolist()
            tensor = {"name": spec["name"], "datatype": "FP32", "shape": [1, len(row)], "data": row}
        bodies.append(json.dumps({"inputs": [tensor]}))
    return artifact.name, bodies, tokens


def start_lit(artifact: str, cfg: dict[str, Any], port: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "bench.lit_server",
        "--artifact",
        artifact,
        "--port",
        str(port),
        "--max-batch-size",
        str(cfg["batching"]["max_batch_size"]),
        "--batch-timeout",
        str(cfg["batching"]["batch_wait_timeout_s"]),
    ]
    with open(log, "wb") as f:
        # Its own process group: LitServe's worker processes outlive a terminated parent.
        return subprocess.Popen(
            cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop_group(proc: subprocess.Popen) -> None:
    """End the LitServe server this benchmark started and its workers (its process group)."""
    import signal

    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke)
    artifact = (
        os.environ.get("B5C_ARTIFACT")
        or ensure_artifact(work, "text", smoke, *TEXT256, tag="text256")["artifact"]
    )
    name, bodies, tokens = request_bodies(artifact)
    cfg = serve_config(work)
    logs = work / "b5c-logs"
    logs.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench-haproxy-")
    body_file = os.path.join(scratch, "bodies.jsonl")
    Path(body_file).write_text("\n".join(bodies) + "\n")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        serve_port, serve_log = free_port(), logs / "serve_ht.log"
        child = start_ht_child(artifact, cfg, serve_port, scratch, serve_log, name)
        stack.callback(_stop, child)
        lit_port = free_port()
        lit = start_lit(artifact, cfg, lit_port, logs / "litserve.log")
        stack.callback(stop_group, lit)
        wait_ready(f"http://127.0.0.1:{lit_port}", 180, path="/health")
        wait_child_ready(child, 300, serve_log)
        urls = {
            "litserve": f"http://127.0.0.1:{lit_port}/predict",
            "serve": f"http://127.0.0.1:{serve_port}/v2/models/{name}/infer",
        }
        windows, quiet = measure(urls, body_file, smoke, CONNECTIONS)
    sides = {c: {k: summarize_side(r) for k, r in by.items()} for c, by in windows.items()}
    ratios = {
        c: ratio(s["serve"]["requests_per_s"], s["litserve"]["requests_per_s"])
        for c, s in sides.items()
    }
    at32 = sides[32]
    met = bool(ratios[32] >= 1.0 and at32["serve"]["p99_ms"] <= at32["litserve"]["p99_ms"])
    details = {
        "artifact": artifact,
        "model": name,
        "request_tokens": {"min": min(tokens), "max": max(tokens)} if tokens else None,
        "by_connections": sides,
        "ratios_rps": ratios,
        "windows_busy": busy_note(quiet),
        "quiet_before_windows": quiet,
        "serve_config": {"batching": cfg["batching"]},
    }
    summary = "; ".join(
        f"c={c}: LitServe {s['litserve']['requests_per_s']:.0f} req/s p99 "
        f"{s['litserve']['p99_ms']:.1f} ms vs Serve {s['serve']['requests_per_s']:.0f} req/s "
        f"p99 {s['serve']['p99_ms']:.1f} ms (x{ratios[c]:.2f})"
        for c, s in sides.items()
    )
    return bench.result(
        "serve_vs_litserve_rps_ratio_at_32_connections", ratios[32], met, details, summary
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
