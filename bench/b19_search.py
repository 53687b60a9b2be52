"""B19 vector search: `POST /v1/models/{index}:search` over HTTP vs the same faiss index searched
in-process, queries/s, on 100k and 1M vectors of dimension 512.

- The vectors: unit vectors drawn around 1,000 random unit centres (clustered, as embeddings
  are; HNSW on uniform noise is unrepresentative), ids `v<n>`, written as a jobs.predict output
  of configs/retrieval.yaml's model trained briefly with `model.embed_dim=512` (the encoder the
  index names; the queries here are raw embeddings, so it only answers the health check).
- The index: `jobs.index` (a subprocess, as a user runs it) with one HNSW setting,
  `index.hnsw_m`=32, `ef_construction`=80, `ef_search`=128, built once per size; its build time
  and bytes per vector from its report.
- Recall: 1,000 held-out queries drawn the same way; the index's top 10 at that `ef_search`
  against the exact top 10 (a brute-force pass in numpy).
- In-process (the peer): the published index opened in this process, 16 threads each calling
  `index.search` with one query at a time, 5 s windows.
- Served: the project's Serve app (bench.serve_child: HAProxy in front, two index replicas on
  the 2 cores) and wrk's 16 connections posting one raw-embedding query a request
  (`top_k` 10), 5 s windows after a warm-up; a sample of its answers checked against the
  in-process ones.
Median of 3 windows each. Goal: served >= 0.7x in-process; recall@10 >= 0.95.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.b5_serve import _stop, start_ht_child, wait_child_ready
from bench.b20_embed import artifact as trained_artifact
from bench.b20_embed import job
from bench.common import Bench, bench_main, free_port, median, ratio, wait_for_quiet
from bench.load import wrk_run

ID = "B19"
GOAL = "served :search >= 0.7x in-process faiss (16 clients each); HNSW recall@10 >= 0.95"
WHAT = "vector search: :search over HTTP (wrk, 16 connections) vs in-process faiss (16 threads)"
SIZES, SMOKE_SIZES = (100_000, 1_000_000), (5_000,)
DIM, CENTRES, SPREAD = 512, 1_000, 0.03
HNSW = ["index.method=hnsw", "index.hnsw_m=32", "index.ef_construction=80", "index.ef_search=128"]
QUERIES, CLIENTS, WINDOW_S, TOP = 1_000, 16, 5.0, 10


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


def served(uri: str, name: str, queries: np.ndarray, found: np.ndarray, work: Path) -> dict:
    import requests

    port = free_port()
    cfg = {
        "autoscaling": {"min_replicas": 2, "max_replicas": 2},
        "replica_cpus": 0.85,
    }  # + the router's 0.25: the 2 CPUs
    log = work / f"serve-{name}.log"
    proc = start_ht_child(uri, cfg, port, tempfile.mkdtemp(prefix="b19-"), log, name=name)
    try:
        ready = wait_child_ready(proc, 900, log)
        url = f"http://127.0.0.1:{port}/v1/models/{name}:search"
        sample = [
            [h["id"] for h in requests.post(url, json=body(q), timeout=60).json()["results"][0]]
            for q in queries[:20]
        ]
        agree = np.mean(
            [s == [f"v{i}" for i in f] for s, f in zip(sample, found[:20], strict=True)]
        )
        bodies = work / f"bodies-{name}.jsonl"
        bodies.write_text("\n".join(json.dumps(body(q)) for q in queries) + "\n")
        wrk_run(url, str(bodies), CLIENTS, 2.0)  # warm-up
        windows = [wrk_run(url, str(bodies), CLIENTS, WINDOW_S) for _ in range(3)]
    finally:
        _stop(proc)
    rates = [w["requests_per_s"] for w in windows]
    return {"qps": median(rates), "windows": windows, "agree": float(agree), "ready": ready}


def body(query: np.ndarray) -> dict[str, Any]:
    return {"query": {"embedding": [round(float(v), 6) for v in query]}, "top_k": TOP}


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
    del index  # the replicas hold their own copies
    wait_for_quiet(120.0)
    http = served(summary["artifact"], name, queries, found, work)
    report = summary["report"]
    return {
        "vectors": n,
        "recall_at_10": recall,
        "build_seconds": report["build_seconds"],
        "bytes_per_vector": report["index_bytes"] / n,
        "in_process_qps": local,
        "served_qps": http["qps"],
        "ratio": ratio(http["qps"], local),
        "served_answers_agree": http["agree"],
        "served": http,
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
    worst = min(r["ratio"] for r in results)
    recall = min(r["recall_at_10"] for r in results)
    summary = "; ".join(
        f"{r['vectors']:,} vectors: served {r['served_qps']:,.0f} vs in-process "
        f"{r['in_process_qps']:,.0f} queries/s (x{r['ratio']:.2f}), recall@10 "
        f"{r['recall_at_10']:.3f}, built in {r['build_seconds']:.0f} s, "
        f"{r['bytes_per_vector']:,.0f} bytes a vector"
        for r in results
    )
    met = worst >= 0.7 and recall >= 0.95
    return bench.result("served_vs_in_process", worst, met, {"sizes": results}, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
