"""B15 generation at engine speed: continuous batching vs one stream per thread, over HTTP.

configs/lm.yaml's GPT (trained briefly, int8 served) behind Serve as cluster/start.sh runs it
(bench.serve_child: HAProxy in front of the replica, serve.generation.max_streams 16), twice:
with the replica's decode loop (serve.generation.continuous_batching, every running stream
advanced by one shared ONNX Runtime call a step) and without it (each stream steps alone on a
worker thread). For 1, 4 and 16 concurrent clients, each streaming `/v1/completions` (a
32-token prompt, 96 tokens at most, sampled, a seed per request) back to back for a 20 s
window: completion tokens per second over all clients (from each answer's usage), time to the
first token (p50, p99) and time per output token after it (p50), from the SSE chunks' arrival.
Goals (the decode loop): at 16 streams at least 4x its own single-stream tokens/s, and a TTFT
p50 at most 3x the single stream's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from bench.b1_train import launch
from bench.b5_serve import _stop, start_ht_child, wait_child_ready
from bench.common import (
    Bench,
    bench_config,
    bench_main,
    ensure_prepared,
    free_port,
    median,
    percentile,
    private_ray,
)

ID = "B15"
WHAT = "generation: continuous batching vs one stream per thread (HTTP, streamed)"
GOAL = "at 16 streams: tokens/s >= 4x its own 1-stream figure, TTFT p50 <= 3x 1-stream's"
STREAMS = (1, 4, 16)
MAX_TOKENS = 96
# About 32 tokens of the kind of text the model was trained on.
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    path = os.path.join(argv[1], 'data')\n"


def one_stream(url: str, seed: int) -> dict[str, float] | None:
    """One streamed completion: its tokens, TTFT and TPOT (ms); None if it failed."""
    body = {
        "model": "lm",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
    }
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with requests.post(url, json=body, stream=True, timeout=60) as r:
        if r.status_code != 200:
            return None
        for block in r.iter_lines(delimiter=b"\n\n"):
            if not block.startswith(b"data: {"):
                continue
            event = json.loads(block[len(b"data: ") :])
            if any(c.get("text") for c in event.get("choices", [])):
                last = time.perf_counter()
                first = first or last
            tokens = event.get("usage", {}).get("completion_tokens", tokens)
    if first is None or last is None:
        return None
    tpot = 1000 * (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return {"tokens": tokens, "ttft_ms": 1000 * (first - start), "tpot_ms": tpot}


def load(url: str, clients: int, seconds: float) -> dict[str, Any]:
    done: list[dict[str, float]] = []
    failed = [0]
    stop = time.perf_counter() + seconds

    def client(k: int) -> None:
        seed = 1000 * k
        while time.perf_counter() < stop:
            seed += 1
            result = one_stream(url, seed)
            if result is None:
                failed[0] += 1
            else:
                done.append(result)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return {
        "clients": clients,
        "completions": len(done),
        "failed": failed[0],
        "tokens_per_s": sum(d["tokens"] for d in done) / elapsed,
        "ttft_p50_ms": median([d["ttft_ms"] for d in done]),
        "ttft_p99_ms": percentile([d["ttft_ms"] for d in done], 99),
        "tpot_p50_ms": median([d["tpot_ms"] for d in done if d["tpot_ms"] == d["tpot_ms"]]),
    }


def side(artifact: str, work: Path, batching: bool, seconds: float) -> dict[int, dict]:
    overrides = (
        f"serve.generation.continuous_batching={str(batching).lower()}",
        f"serve.generation.max_streams={max(STREAMS)}",
        "serve.autoscaling.min_replicas=1",
        "serve.autoscaling.max_replicas=1",
    )
    cfg = bench_config(work, "lm", *overrides, tag="b15").serve.model_dump(mode="json")
    port, scratch = free_port(), tempfile.mkdtemp(prefix="b15-haproxy-")
    log = work / "logs" / f"b15_{'loop' if batching else 'threads'}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    child = start_ht_child(artifact, cfg, port, scratch, log, name="lm")
    try:
        wait_child_ready(child, 300, log)
        url = f"http://127.0.0.1:{port}/v1/completions"
        load(url, 2, 2.0)  # warm-up
        return {n: load(url, n, seconds) for n in STREAMS}
    finally:
        _stop(child)
        shutil.rmtree(scratch, ignore_errors=True)


def lm_artifact(work: Path, smoke: bool) -> str:
    """configs/lm.yaml trained briefly by jobs.train on a private Ray, exported (once per --work).
    B15 measures speed: the model only has to be a real export of this GPT."""
    from app.export.exporter import export

    overrides = [
        "train.epochs=1",
        f"train.max_steps_per_epoch={4 if smoke else 40}",
        "train.num_workers=1",
        "export.name=lm",
        "export.max_perplexity_increase=100",
    ]
    config = bench_config(work, "lm", *overrides, tag="b15")
    ensure_prepared(config)
    done = work / "b15-artifact.json"
    if done.exists():
        return json.loads(done.read_text())["artifact"]
    summary = work / "b15-train.json"
    cmd = [sys.executable, "-m", "jobs.train", "--config", "configs/lm.yaml"]
    cmd += [f"data.output={config.data_output}", f"train.storage_path={config.storage_path}"]
    cmd += [*overrides, f"train.run_name=b15-{int(time.time())}", "--summary-file", str(summary)]
    with private_ray() as ray_info:
        trained = launch(cmd, summary, dict(os.environ, RAY_ADDRESS=ray_info["address"]))
    artifact = export(config, trained["checkpoint"])["artifact"]
    done.write_text(json.dumps({"artifact": artifact}))
    return artifact


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    artifact = lm_artifact(work, smoke)
    seconds = 4.0 if smoke else 20.0
    # Alternating sides would restart Ray each window; each side runs whole, threads first.
    threads = side(artifact, work, batching=False, seconds=seconds)
    loop = side(artifact, work, batching=True, seconds=seconds)
    top = max(STREAMS)
    speedup = loop[top]["tokens_per_s"] / threads[top]["tokens_per_s"]
    scaling = loop[top]["tokens_per_s"] / loop[1]["tokens_per_s"]
    ttft_growth = loop[top]["ttft_p50_ms"] / loop[1]["ttft_p50_ms"]
    met = bool(scaling >= 4 and ttft_growth <= 3)
    per_count = "; ".join(
        f"{n} streams: loop {loop[n]['tokens_per_s']:.0f} tok/s (TTFT p50 "
        f"{loop[n]['ttft_p50_ms']:.0f} p99 {loop[n]['ttft_p99_ms']:.0f} ms, TPOT "
        f"{loop[n]['tpot_p50_ms']:.1f} ms) vs threads {threads[n]['tokens_per_s']:.0f} tok/s"
        for n in STREAMS
    )
    summary = (
        f"{per_count}; at {top}: x{scaling:.2f} its 1-stream tokens/s, TTFT x{ttft_growth:.2f}, "
        f"x{speedup:.2f} one stream per thread"
    )
    details = {
        "loop": loop,
        "threads": threads,
        "max_tokens": MAX_TOKENS,
        "prompt": PROMPT,
        "window_s": seconds,
        "loop_vs_threads_at_top": speedup,
        "ttft_growth_at_top": ttft_growth,
    }
    return bench.result("tokens_per_s_at_16_vs_1_stream", scaling, met, details, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
