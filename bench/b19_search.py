"""B19 vector search: `POST /v1/models/{index}:search` through Serve vs the same app in a plain
uvicorn server, queries/s, on 100k and 1M vectors of dimension 512.

- The vectors: unit vectors drawn around 1,000 random unit centres (clustered, as embeddings
  are; HNSW on uniform noise is unrepresentative), ids `v<n>`, written as a jobs.predict output
  of configs/retrieval.yaml's model trained briefly with `model.embed_dim=512` (the encoder the
  index names; the queries here are raw embeddings, so it only answers the health check).
- The index: `jobs.index` (a subprocess, as a user runs it) with one HNSW setting,
  `index.hnsw_m`=32, `ef_construction`=80, `ef_search`=128, built once per size; its build time
  and bytes per vector from its report.
- Recall: 1,000 held-out queries drawn the same way; the index's top 10 at that `ef_search`
  against the exact top 10 (a brute-force pass in numpy).
- Served: the project's Serve app (bench.serve_child: HAProxy in front, two index replicas on
  the 2 cores; the index's application holds the `:search` path, one hop); plain (the peer,
  the B5a method): bench.plain_server --search, the same FastAPI app and SearchServer in two
  uvicorn worker processes. Both take the same bodies from wrk's 16 connections, three kinds:
  one query a request as JSON floats, the same as base64 float32 (`encoding_format`), and 16
  base64 queries a request (`batched`, counted in queries); `top_k` 10; 5 s windows after a
  warm-up, a sample of answers checked against in-process faiss. In-process faiss (16 threads,
  one query a call) is reported beside them.
Median of 3 windows each. Goal at every size: served >= 0.8x plain for each kind of body,
served single queries >= 2.5x the 455 queries/s the two-hop route answered at 100k, and
recall@10 >= 0.95.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.b5_serve import _stop, start_ht_child, wait_child_ready
from bench.b20_embed import artifact as trained_artifact
from bench.b20_embed import job
from bench.common import (
    REPO,
    Bench,
    bench_main,
    free_port,
    median,
    ratio,
    server_command,
    wait_for_quiet,
)
from bench.load import wrk_run

ID = "B19"
GOAL = (
    "served :search >= 0.8x plain uvicorn for each body; single queries >= 1,138/s "
    "(2.5x the two-hop 455); HNSW recall@10 >= 0.95"
)
WHAT = "vector search: :search via Serve vs plain uvicorn, same app (wrk, 16 connections)"
SIZES, SMOKE_SIZES = (100_000, 1_000_000), (5_000,)
DIM, CENTRES, SPREAD = 512, 1_000, 0.03
HNSW = ["index.method=hnsw", "index.hnsw_m=32", "index.ef_construction=80", "index.ef_search=128"]
QUERIES, CLIENTS, WINDOW_S, TOP = 1_000, 16, 5.0, 10
BATCH = 16  # queries a request in the `batched` bodies
KINDS = ("float", "base64", "batched")
TWO_HOP_QPS = 455.0  # the 100k figure when :search went through the application at `/`
PROCESSES = 2


def clustered(rng: np.random.Generator, centres: np.ndarray, n: int) -> np.ndarray:
    x = centres[rng.integers(0, len(centres), n)] + rng.normal(0, SPREAD, (n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def encoder(work: Path) -> str:
    """configs/retrieval.yaml at 512 dimensions, trained briefly and exported, once."""
    return trained_artifact(work, f"model.embed_dim={DIM}", saved="encoder.json")


def embeddings(work: Path, artifact: str, n: int, centres: np.ndarray) -> str:
    """n clustered vectors as a jobs.predict output (parts of 100k rows), once per size."""
    import pyarrow as pa

    from app.predict.write import PartWriter, PredictionManifest
    from app.runtime.artifact import open_artifact

    folder = work / f"vectors-{n}"
    if (folder / "manifest.json").exists():
        return str(folder)
    art, rng = open_artifact(artifact), np.random.default_rng(1)
    writer = PartWriter(str(folder), "", rows_per_file=100_000, run="b19")
    for start in range(0, n, 100_000):
        count = min(100_000, n - start)
        flat = pa.array(clustered(rng, centres, count).reshape(-1))
        ids = pa.array([f"v{i}" for i in range(start, start + count)])
        writer.write(
            pa.table({"id": ids, "embedding": pa.FixedSizeListArray.from_arrays(flat, DIM)})
        )
    PredictionManifest(
        created="bench",
        artifact=art.uri,
        model_name=art.name,
        model_version=art.version,
        variant="fp32",
        input="generated",
        input_format="parquet",
        id_column="id",
        on_bad_rows="fail",
        rows={"input": n, "output": n, "rejected": 0},
        files=writer.close(),
        rejects=[],
    ).write(str(folder / "manifest.json"))
    return str(folder)


def exact_top(vectors_dir: str, queries: np.ndarray) -> np.ndarray:
    """The exact top 10 by jobs.index's own streamed brute-force pass."""
    from app.predict.write import verify_output
    from app.tasks.index.build import exact_top as streamed

    parts = [os.path.join(vectors_dir, s.file) for s in verify_output(vectors_dir).files]
    return streamed(queries, parts, 100_000)


def in_process(index: Any, queries: np.ndarray) -> float:
    """CLIENTS threads, one query a call, for WINDOW_S: queries/s."""
    done = [0] * CLIENTS
    stop = time.monotonic() + WINDOW_S

    def client(c: int) -> None:
        i = c
        while time.monotonic() < stop:
            index.search(queries[i % len(queries)][None], TOP)
            done[c] += 1
            i += CLIENTS

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.monotonic() - started)


def serve_config() -> dict[str, Any]:
    return {
        "autoscaling": {"min_replicas": PROCESSES, "max_replicas": PROCESSES},
        "replica_cpus": 0.85,
    }  # + the router's 0.25: the 2 CPUs


def bodies(queries: np.ndarray, kind: str) -> list[dict[str, Any]]:
    if kind == "batched":
        groups = [queries[i : i + BATCH] for i in range(0, len(queries) - BATCH + 1, BATCH)]
        return [
            {
                "queries": [{"embedding": b64(q)} for q in g],
                "top_k": TOP,
                "encoding_format": "base64",
            }
            for g in groups
        ]
    if kind == "base64":
        return [
            {"query": {"embedding": b64(q)}, "top_k": TOP, "encoding_format": "base64"}
            for q in queries
        ]
    return [
        {"query": {"embedding": [round(float(v), 6) for v in q]}, "top_k": TOP} for q in queries
    ]


def b64(vector: np.ndarray) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode()


def measured(url: str, queries: np.ndarray, found: np.ndarray, work: Path, tag: str) -> dict:
    """Answers checked against in-process faiss, then 3 windows of each kind of body."""
    import requests

    sample = [
        [h["id"] for h in requests.post(url, json=b, timeout=60).json()["results"][0]]
        for b in bodies(queries[:20], "base64")
    ]
    agree = np.mean([s == [f"v{i}" for i in f] for s, f in zip(sample, found[:20], strict=True)])
    out: dict[str, Any] = {"agree": float(agree)}
    for kind in KINDS:
        path = work / f"bodies-{tag}-{kind}.jsonl"
        path.write_text("\n".join(json.dumps(b) for b in bodies(queries, kind)) + "\n")
        wrk_run(url, str(path), CLIENTS, 2.0)  # warm-up
        windows = [wrk_run(url, str(path), CLIENTS, WINDOW_S) for _ in range(3)]
        per = BATCH if kind == "batched" else 1
        out[kind] = {
            "qps": per * median([w["requests_per_s"] for w in windows]),
            "windows": windows,
        }
    return out


def served(uri: str, name: str, queries: np.ndarray, found: np.ndarray, work: Path) -> dict:
    port = free_port()
    log = work / f"serve-{name}.log"
    proc = start_ht_child(
        uri, serve_config(), port, tempfile.mkdtemp(prefix="b19-"), log, name=name
    )
    try:
        ready = wait_child_ready(proc, 900, log)
        url = f"http://127.0.0.1:{port}/v1/models/{name}:search"
        return measured(url, queries, found, work, f"serve-{name}") | {"ready": ready}
    finally:
        _stop(proc)


def plain(uri: str, name: str, queries: np.ndarray, found: np.ndarray, work: Path) -> dict:
    """bench.plain_server --search in PROCESSES uvicorn workers: the same app, no Ray."""
    import requests

    port = free_port()
    cmd = server_command("bench.plain_server", uri, port, serve_config(), "--search")
    cmd += ["--processes", str(PROCESSES)]
    log = work / f"plain-{name}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1/models/{name}:search"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5).ok:
                    break
            except requests.RequestException:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"plain server not ready: {log.read_text()[-2000:]}")
            time.sleep(1)
        return measured(url, queries, found, work, f"plain-{name}")
    finally:
        _stop(proc)


def one_size(work: Path, artifact: str, n: int, centres: np.ndarray) -> dict[str, Any]:
    from app.runtime.vector_index import open_index, set_search_params

    folder = embeddings(work, artifact, n, centres)
    name = f"b19-{n}"
    built = work / f"index-{n}.json"
    if not built.exists():
        config = ["--config", "configs/retrieval.yaml", f"export.registry={work}/registry"]
        summary = job("index", *config, "--embeddings", folder, *HNSW, f"index.name={name}")
        built.write_text(json.dumps(summary))
    summary = json.loads(built.read_text())
    queries = clustered(np.random.default_rng(2), centres, QUERIES)
    index = open_index(summary["artifact"])
    set_search_params(index.index, index.schema["ef_search"], index.schema["nprobe"])
    _, found = index.index.search(queries, TOP)
    exact = exact_top(folder, queries)
    recall = float(np.mean([len(set(a) & set(b)) / TOP for a, b in zip(found, exact, strict=True)]))
    wait_for_quiet(120.0)
    local = median([in_process(index.index, queries) for _ in range(3)])
    del index  # the servers hold their own copies
    wait_for_quiet(120.0)
    http = served(summary["artifact"], name, queries, found, work)
    wait_for_quiet(120.0)
    peer = plain(summary["artifact"], name, queries, found, work)
    report = summary["report"]
    return {
        "vectors": n,
        "recall_at_10": recall,
        "build_seconds": report["build_seconds"],
        "bytes_per_vector": report["index_bytes"] / n,
        "in_process_qps": local,
        "served_qps": {k: http[k]["qps"] for k in KINDS},
        "plain_qps": {k: peer[k]["qps"] for k in KINDS},
        "ratios": {k: ratio(http[k]["qps"], peer[k]["qps"]) for k in KINDS},
        "served_answers_agree": http["agree"],
        "plain_answers_agree": peer["agree"],
        "served": http,
        "plain": peer,
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    artifact = encoder(work)
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(CENTRES, DIM))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    sizes = (
        SMOKE_SIZES
        if smoke
        else tuple(n for n in SIZES if n <= int(os.environ.get("B19_MAX_VECTORS", SIZES[-1])))
    )
    results = [one_size(work, artifact, n, centres) for n in sizes]
    worst = min(min(r["ratios"].values()) for r in results)
    single = min(max(r["served_qps"]["float"], r["served_qps"]["base64"]) for r in results)
    recall = min(r["recall_at_10"] for r in results)
    summary = "; ".join(
        f"{r['vectors']:,} vectors: "
        + ", ".join(
            f"{k} served {r['served_qps'][k]:,.0f} vs plain {r['plain_qps'][k]:,.0f} q/s "
            f"(x{r['ratios'][k]:.2f})"
            for k in KINDS
        )
        + f"; in-process {r['in_process_qps']:,.0f}; recall@10 {r['recall_at_10']:.3f}, built in "
        f"{r['build_seconds']:.0f} s, {r['bytes_per_vector']:,.0f} bytes a vector"
        for r in results
    )
    met = worst >= 0.8 and recall >= 0.95 and (smoke or single >= 2.5 * TWO_HOP_QPS)
    details = {"sizes": results, "single_query_served_qps": single}
    return bench.result("served_vs_plain", worst, met, details, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
