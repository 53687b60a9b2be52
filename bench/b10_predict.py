"""B10 batch inference that scales with the data: jobs.predict at 1M, 10M and 100M rows against
the per-row ceiling its own stages set, on the same machine and the same tabular artifact.

- batch: app.predict.driver.predict (what `python -m jobs.predict` runs) over breast-cancer-like
  rows generated as Parquet shards of 1M rows (1M, 10M and 100M rows, deleted after the run; 5k
  and 20k in smoke),
  int8 as served, in a private 2-CPU Ray; rows/s over the whole stage (artifact checks, actor
  start, read, inference, writing and publishing the output) and the peak memory (PSS) of the
  whole Ray process tree while it runs;
- the ceiling: the four stages of a batch timed alone on one core over 100k rows (read the
  Parquet shard, check and preprocess the rows, ONNX Runtime, write the output part), summed
  as microseconds per row; the cores times its inverse is what the job could reach with no
  overhead at all;
- online, for context: the project's Serve app as cluster/start.sh runs it (bench.serve_child:
  HAProxy in front of one int8 replica), v2 JSON infer requests of 1, 64, 256 and 1024 rows at
  8 and 32 connections (wrk, 4 s windows after a 1 s warm-up); the best rows/s of that grid.
A sample of the batch output is sent to the endpoint and the answers compared. Goals: batch
rows/s at least 0.8x the ceiling times the cores at every size; peak memory at the largest size
at most 1.2x the smallest's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.b5_serve import _stop, start_ht_child, wait_child_ready
from bench.b8_memory import PeakMemory
from bench.common import (
    Bench,
    bench_config,
    bench_main,
    ensure_artifact,
    free_port,
    private_ray,
    wait_for_quiet,
)
from bench.load import wrk_run

ID = "B10"
WHAT = "batch inference at 1M/10M/100M rows: jobs.predict vs its per-row ceiling x cores, memory"
GOAL = "jobs.predict rows/s >= 0.8x the per-row ceiling x cores; peak memory at 100M <= 1.2x 1M's"
SIZES, SMOKE_SIZES = (1_000_000, 10_000_000, 100_000_000), (5_000, 20_000)
SHARD_ROWS = 1_000_000
REQUEST_ROWS, CONNECTIONS = (1, 64, 256, 1024), (8, 32)
SAMPLE = 256


def scoring_input(work: Path, config, rows: int) -> tuple[str, list[str]]:
    """`rows` rows drawn from the prepared breast-cancer table with a little noise, ids 0..n-1,
    written in shards of SHARD_ROWS (made once per --work and size, a chunk at a time)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.ingest import iter_shards
    from app.data.prepare import read_manifest, split_files

    manifest = read_manifest(config.data_output)
    columns = list(manifest.feature_columns)
    folder = work / f"b10-input-{rows}"
    if (folder / "DONE").exists():
        return str(folder), columns
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    source = next(iter_shards(split_files(config.data_output, manifest, "train")))
    base = source[columns].to_numpy(np.float64)
    rng = np.random.default_rng(0)
    for part, start in enumerate(range(0, rows, SHARD_ROWS)):
        n = min(SHARD_ROWS, rows - start)
        picked = base[rng.integers(0, len(base), n)] * rng.normal(1.0, 0.02, (n, len(columns)))
        table = {"id": pa.array(np.arange(start, start + n))}
        table |= {c: picked[:, j] for j, c in enumerate(columns)}
        pq.write_table(pa.table(table), folder / f"part-{part:05d}.parquet")
    (folder / "DONE").touch()
    return str(folder), columns


def run_batch(config, artifact: str, input_uri: str, output: str) -> dict[str, Any]:
    """jobs.predict's stage in a private Ray: its summary, wall time and the peak PSS of the
    Ray process tree (this process, the raylet, the object store, the actors) meanwhile."""
    from app.predict.driver import predict

    with private_ray() as ray_info, PeakMemory(interval=0.5) as memory:
        start = time.perf_counter()
        summary = predict(config, artifact, input_uri, output, overwrite=True)
        wall = time.perf_counter() - start
    return {
        **summary,
        "wall_s": wall,
        "rows_per_s": summary["rows"] / wall,
        "peak_memory_bytes": memory.peak,
        "peak_memory_by_kind": memory.peak_by_kind,
        "ray": ray_info,
    }


def infer_body(rows: np.ndarray) -> bytes:
    tensor = {
        "name": "features",
        "datatype": "FP32",
        "shape": list(rows.shape),
        "data": rows.reshape(-1).tolist(),
    }
    return json.dumps({"inputs": [tensor]}).encode()


def run_online(config, artifact: str, sample: np.ndarray, work: Path, smoke: bool) -> dict:
    """The endpoint as cluster/start.sh runs it, over the grid of request sizes and
    connections; its answer for the sample rows."""
    cfg = config.serve.model_dump(mode="json")
    cfg["autoscaling"].update(min_replicas=1, max_replicas=1)
    port, scratch = free_port(), tempfile.mkdtemp(prefix="b10-")
    log = work / "logs" / "b10_serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    child = start_ht_child(artifact, cfg, port, scratch, log, name="tabular")
    grid: dict[str, Any] = {}
    try:
        wait_child_ready(child, 300, log)
        url = f"http://127.0.0.1:{port}/v2/models/tabular/infer"
        for n in REQUEST_ROWS:
            body_file = os.path.join(scratch, f"body-{n}.jsonl")
            Path(body_file).write_bytes(infer_body(sample[:n]) + b"\n")
            for c in CONNECTIONS:
                wrk_run(url, body_file, c, 1.0)  # warm-up
                result = wrk_run(url, body_file, c, 2.0 if smoke else 4.0)
                result["rows_per_s"] = result["requests_per_s"] * n
                grid[f"rows_{n}_conns_{c}"] = {"rows_per_request": n, **result}
        answer = _answer(url, sample)
    finally:
        _stop(child)
        shutil.rmtree(scratch, ignore_errors=True)
    return {"grid": grid, "sample_answer": answer}


def stage_costs(artifact: str, input_uri: str, config, rows: int = 100_000) -> dict[str, float]:
    """Microseconds per row of each stage of a batch, each timed alone on one core: read the
    first shard's first `rows` rows, check and preprocess them, ONNX Runtime (int8, one thread,
    predict.batch_size rows a call), write the output columns to Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.runtime.artifact import open_artifact, run_logits
    from app.runtime.rows import softmax

    loaded = open_artifact(artifact)
    columns = loaded.schema["feature_columns"]
    shard = sorted(Path(input_uri).glob("part-*.parquet"))[0]
    timings: dict[str, float] = {}

    def timed(name: str, fn):
        start = time.perf_counter()
        out = fn()
        timings[name] = 1e6 * (time.perf_counter() - start) / rows
        return out

    table = timed("read", lambda: pq.read_table(shard).slice(0, rows))
    raw = timed(
        "preprocess",
        lambda: loaded.preprocessor.features(
            np.stack([table[c].to_numpy() for c in columns], 1).astype(np.float32)
        ),
    )
    session = loaded.session("int8", 1)
    step = config.predict.batch_size

    def infer() -> np.ndarray:
        parts = [
            softmax(run_logits(session, {k: v[i : i + step] for k, v in raw.items()}))
            for i in range(0, rows, step)
        ]
        return np.concatenate(parts)

    probabilities = timed("onnxruntime", infer)
    labels = np.asarray(loaded.preprocessor.labels)[probabilities.argmax(1)]
    out = pa.table(
        {
            "id": table["id"],
            "label": pa.array(labels.tolist()),
            "probabilities": pa.array(list(probabilities)),
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        timed("write", lambda: pq.write_table(out, os.path.join(tmp, "part.parquet")))
    return timings


def _answer(url: str, rows: np.ndarray) -> dict[str, Any]:
    import requests

    r = requests.post(url, data=infer_body(rows), timeout=60)
    r.raise_for_status()
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    probabilities = np.asarray(outputs["probabilities"]["data"], np.float32).reshape(len(rows), -1)
    return {"labels": outputs["label"]["data"], "probabilities": probabilities}


def compare(output: str, manifest_files: list[str], ids: np.ndarray, online: dict) -> dict:
    """The batch output's rows for `ids` against the endpoint's answer for the same rows."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    wanted = pa.array(ids)  # the sample's rows only: the output may hold 100M
    table = pa.concat_tables(
        [
            (part := pq.read_table(f"{output}/{f}")).filter(pc.is_in(part["id"], wanted))
            for f in manifest_files
        ]
    )
    index = {int(i): k for k, i in enumerate(table["id"].to_pylist())}
    take = [index[int(i)] for i in ids]
    labels = [table["label"][k].as_py() for k in take]
    probabilities = np.asarray([table["probabilities"][k].as_py() for k in take], np.float32)
    return {
        "rows": len(ids),
        "label_agreement": float(
            np.mean([a == b for a, b in zip(labels, online["labels"], strict=True)])
        ),
        "max_abs_probability_diff": float(np.abs(probabilities - online["probabilities"]).max()),
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    from app.predict.write import verify_output

    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    sizes = SMOKE_SIZES if smoke else SIZES
    artifact = ensure_artifact(work, "tabular", smoke)["artifact"]
    config = bench_config(work, "tabular")
    batches: dict[int, dict[str, Any]] = {}
    for rows in sizes:
        input_uri, columns = scoring_input(work, config, rows)
        wait_for_quiet(30 if smoke else 120)
        output = str(work / "b10-output")
        batches[rows] = run_batch(config, artifact, input_uri, output)
        verify_output(batches[rows]["output"])
        if rows != sizes[0]:  # the largest inputs would fill the disk: made again when needed
            shutil.rmtree(input_uri, ignore_errors=True)
    import pyarrow.parquet as pq

    input_uri, columns = scoring_input(work, config, sizes[0])

    first = sorted(Path(input_uri).glob("part-*.parquet"))[0]
    source = pq.read_table(first).slice(0, SAMPLE)
    sample = np.stack([source[c].to_numpy() for c in columns], 1).astype(np.float32)
    wait_for_quiet(30 if smoke else 120)
    online = run_online(config, artifact, sample, work, smoke)
    manifest = verify_output(output)
    agreement = compare(
        output,
        [s.file for s in manifest.files],
        source["id"].to_numpy(),
        online.pop("sample_answer"),
    )
    costs = stage_costs(artifact, input_uri, config, min(100_000, sizes[-1]))
    best = max(online["grid"].values(), key=lambda r: r["rows_per_s"])
    cores = len(os.sched_getaffinity(0))
    ceiling = cores * 1e6 / sum(costs.values())  # rows/s with no overhead at all
    ratios = {n: batches[n]["rows_per_s"] / ceiling for n in sizes}
    memory_growth = batches[sizes[-1]]["peak_memory_bytes"] / batches[sizes[0]]["peak_memory_bytes"]
    met = bool(min(ratios.values()) >= 0.8 and memory_growth <= 1.2)
    details = {
        "batch": {
            n: {k: b[k] for k in ("rows", "wall_s", "rows_per_s", "peak_memory_bytes", "variant")}
            | {"peak_memory_by_kind": b["peak_memory_by_kind"], "ray": b["ray"]}
            for n, b in batches.items()
        },
        "online": online["grid"],
        "online_best": {k: best[k] for k in ("rows_per_request", "connections", "rows_per_s")},
        "batch_vs_ceiling": ratios,
        "ceiling_rows_per_s": ceiling,
        "cores": cores,
        "batch_vs_online_best": {
            n: b["rows_per_s"] / best["rows_per_s"] for n, b in batches.items()
        },
        "peak_memory_growth_largest_vs_smallest": memory_growth,
        "stage_us_per_row_one_core": costs,
        "batch_wall_us_per_row": {n: 1e6 / b["rows_per_s"] for n, b in batches.items()},
        "sample_agreement": agreement,
        "settings": config.predict.model_dump(mode="json"),
    }
    summary = (
        "; ".join(
            f"{n:,} rows: {b['rows_per_s']:,.0f} rows/s (x{ratios[n]:.2f} the ceiling), "
            f"peak {b['peak_memory_bytes'] / 2**20:,.0f} MiB"
            for n, b in batches.items()
        )
        + f"; ceiling {ceiling:,.0f} rows/s on {cores:g} cores; online best "
        + f"{best['rows_per_s']:,.0f} rows/s ({best['rows_per_request']} rows x "
        + f"{best['connections']} connections); memory x{memory_growth:.2f} from "
        + f"{sizes[0]:,} to {sizes[-1]:,} rows; per row on one core: "
        + ", ".join(f"{k} {v:.2f} us" for k, v in costs.items())
        + f"; sample labels agree {100 * agreement['label_agreement']:.1f}%"
    )
    return bench.result("batch_vs_ceiling_ratio", min(ratios.values()), met, details, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
